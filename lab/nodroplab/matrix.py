"""lab/flavors.toml: sources, flavors, series, config fragments."""

from __future__ import annotations

import ast
import hashlib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .common import LAB_DIR, REPO, LabError

MATRIX_FILE = LAB_DIR / "flavors.toml"


@dataclass(frozen=True)
class Source:
    name: str
    package: str
    version: str
    suite: str
    private_apt: bool
    sha256: str | None
    mirror: str = "http://deb.debian.org/debian"
    components: str = "main"
    keyring: str = "/usr/share/keyrings/debian-archive-keyring.gpg"

    @property
    def deb_name(self) -> str:
        # apt-get download's file name (an epoch ':' is written as %3a)
        return f"{self.package}_{self.version.replace(':', '%3a')}_all.deb"


@dataclass(frozen=True)
class Flavor:
    name: str
    description: str
    source: Source
    series: Path | None                # absolute path of the series file
    fragments: tuple[Path, ...]        # absolute paths, merge order
    localversion: str
    chaos: str | None = None           # debug sibling: `make test` runs the chaos round on it
    # what the flavor must support (tunlib.FEATURES); None: not declared
    features: tuple[str, ...] | None = None
    allowed_skips: tuple[tuple[str, str], ...] = ()    # (test glob, reason regex)
    known_failures: tuple[tuple[str, str], ...] = ()   # (test, message regex): measured defects

    def config_hash(self) -> str:
        """Everything that decides .config: method, fragments (content), localversion."""
        h = hashlib.sha256()
        h.update(b"tinyconfig+merge_config+olddefconfig\n")
        for frag in self.fragments:
            h.update(frag.name.encode() + b"\n")
            h.update(frag.read_bytes())
        h.update(f"localversion={self.localversion}\n".encode())
        return h.hexdigest()

    def patches(self) -> list[Path]:
        """Patch files in series order, 0000-* (cover letter) skipped."""
        if self.series is None:
            return []
        if not self.series.is_file():
            raise LabError(f"{self.name}: series file {self.series} does not exist")
        out = []
        for lineno, raw in enumerate(self.series.read_text().splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if Path(line).name.startswith("0000"):
                continue
            p = (self.series.parent / line).resolve()
            if not p.is_file():
                raise LabError(f"{self.series}:{lineno}: patch {line} not found")
            out.append(p)
        return out

    def series_hash(self) -> str:
        """sha256 of the series file + every patch it lists (names and bytes).

        Without a series this is the sha256 of the empty string."""
        h = hashlib.sha256()
        if self.series is None:
            return h.hexdigest()
        h.update(self.series.read_bytes())
        for p in self.patches():
            h.update(b"\0" + p.name.encode() + b"\0")
            h.update(p.read_bytes())
        return h.hexdigest()


@dataclass
class Matrix:
    sources: dict[str, Source]
    flavors: dict[str, Flavor]
    test_default: list[str] = field(default_factory=list)
    bench_default: list[str] = field(default_factory=list)
    chaos_default: list[str] = field(default_factory=list)
    package_default: list[str] = field(default_factory=list)   # root-filesystem flavors

    def flavor(self, name: str) -> Flavor:
        if name not in self.flavors:
            valid = ", ".join(self.flavors)
            raise LabError(f"unknown flavor '{name}'; valid flavors: {valid}", rc=2)
        return self.flavors[name]


def _rel(p: str) -> Path:
    return (REPO / p).resolve()


TUNLIB = REPO / "tests" / "guest" / "tunlib.py"


def known_features() -> tuple[str, ...]:
    """tunlib.FEATURES, the guest suite's list (one source of truth)."""
    for node in ast.parse(TUNLIB.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "FEATURES" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise LabError(f"{TUNLIB}: no FEATURES tuple")


def _pairs(path: Path, name: str, key: str, entries, second: str) -> tuple:
    out = []
    for e in entries:
        if not isinstance(e, dict) or set(e) != {"test", second}:
            raise LabError(f"{path}: flavor {name}: each {key} entry is a table with "
                           f"exactly `test` and `{second}` (got {e!r})")
        out.append((e["test"], e[second]))
    return tuple(out)


def _check_chaos_sibling(path: Path, fl: Flavor, flavors: dict[str, Flavor]) -> None:
    """A flavor's `chaos` names a flavor of the same source and series (its
    debug build): the round must exercise the code the flavor ships."""
    if fl.chaos is None:
        return
    sib = flavors.get(fl.chaos)
    if sib is None:
        raise LabError(f"{path}: flavor {fl.name}: chaos = {fl.chaos!r} is not a flavor")
    if (sib.source, sib.series) != (fl.source, fl.series):
        raise LabError(f"{path}: flavor {fl.name}: chaos = {fl.chaos!r} has another "
                       f"source or series; a chaos sibling must build the same code")


def load(path: Path = MATRIX_FILE) -> Matrix:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise LabError(f"cannot read {path}: {e}")
    sources = {}
    for name, s in data.get("sources", {}).items():
        try:
            sources[name] = Source(
                name=name, package=s["package"], version=s["version"],
                suite=s["suite"], private_apt=bool(s.get("private_apt", False)),
                sha256=s.get("sha256"),
                mirror=s.get("mirror", "http://deb.debian.org/debian"),
                components=s.get("components", "main"),
                keyring=s.get("keyring", "/usr/share/keyrings/debian-archive-keyring.gpg"))
        except KeyError as e:
            raise LabError(f"{path}: source {name}: missing key {e}")
    flavors = {}
    features = set(known_features())
    for name, f in data.get("flavors", {}).items():
        src = f.get("source")
        if src not in sources:
            raise LabError(f"{path}: flavor {name}: unknown source {src!r}")
        frags = tuple(_rel(x) for x in f.get("fragments", []))
        if not frags:
            raise LabError(f"{path}: flavor {name}: no config fragments")
        for fr in frags:
            if not fr.is_file():
                raise LabError(f"{path}: flavor {name}: fragment {fr} not found")
        flavors[name] = Flavor(
            name=name, description=f.get("description", ""), source=sources[src],
            series=_rel(f["series"]) if f.get("series") else None,
            fragments=frags, localversion=f.get("localversion", ""),
            chaos=f.get("chaos"),
            features=tuple(f["features"]) if "features" in f else None,
            allowed_skips=_pairs(path, name, "allowed_skips", f.get("allowed_skips", []),
                                 "reason"),
            known_failures=_pairs(path, name, "known_failures", f.get("known_failures", []),
                                  "message"))
        bad = set(flavors[name].features or ()) - features
        if bad:
            raise LabError(f"{path}: flavor {name}: unknown features {sorted(bad)}; "
                           f"known: {' '.join(sorted(features))}")
    for fl in flavors.values():
        _check_chaos_sibling(path, fl, flavors)
    m = data.get("matrix", {})
    mx = Matrix(sources, flavors, list(m.get("test", [])), list(m.get("bench", [])),
                list(m.get("chaos", [])), list(m.get("package", [])))
    for n in mx.test_default + mx.bench_default + mx.chaos_default:
        mx.flavor(n)
    return mx
