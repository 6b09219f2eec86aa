// nodrop-seedcheck: parse syzkaller seed programs against the descriptions
// this syzkaller tree was built with, as syz-manager does (non-strict) and
// strictly (no field left to a default), so that a seed of ours that the
// manager would drop or silently repair fails the lab's build instead.
// Built by lab/nodroplab/fuzz.py into bin/nodrop-seedcheck; usage:
// nodrop-seedcheck FILE... (exit status: the number of bad files).
package main

import (
	"fmt"
	"os"

	"github.com/google/syzkaller/pkg/manager"
	"github.com/google/syzkaller/prog"
	_ "github.com/google/syzkaller/sys"
)

func main() {
	target, err := prog.GetTarget("linux", "amd64")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(100)
	}
	bad := 0
	for _, f := range os.Args[1:] {
		data, err := os.ReadFile(f)
		if err == nil {
			_, err = manager.ParseSeed(target, data)
		}
		if err == nil {
			_, err = target.Deserialize(data, prog.Strict)
		}
		if err != nil {
			fmt.Printf("%s: %v\n", f, err)
			bad++
			continue
		}
		fmt.Printf("%s: ok\n", f)
	}
	os.Exit(bad)
}
