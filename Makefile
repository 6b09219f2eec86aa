# NODROP top-level Makefile: thin wrappers around the lab orchestrator
# (lab/nodroplab, Python 3 stdlib). See README.md and docs/lab.md.
#
#   make test                      deps, fetch, tools, build + boot + guest suite
#   make test FLAVORS=mainline-7.3 other flavors (lab/flavors.toml)
#   make chaos DURATION=600        debug flavors: chaos round (SEED=n reproduces one)
#   make bench                     build, boot and benchmark the four bench flavors
#   make kernel FLAVOR=nodrop-6.12 build or reuse one kernel, print its bzImage
#                                  (REBUILD=1: run make even if up to date)
#   make run FLAVOR=stock-6.12 CMD='ip -s link'
#   make fuzz FLAVOR=seed-v1-6.12 DURATION=3600
#                                  syzkaller on a fuzz flavor (docs/fuzz.md);
#                                  make fuzz-smoke: 2 min, fails unless programs ran
#   make mutants [MUTANTS="no-stop ..."]
#                                  break the series on purpose (tests/mutants/),
#                                  check the guarding tests fail; not in make test
#   make tools | deps | fetch | flavors | kvm
#   make dkms | package            nodrop-dkms source tree / .deb in dist/ (docs/dkms.md)
#   make test-package              the .deb end to end on Debian 12 and 13 (FLAVORS=debian-12)

PYTHON ?= python3
LAB = PYTHONPATH=$(CURDIR)/lab PYTHONDONTWRITEBYTECODE=1 $(PYTHON) -m nodroplab

.PHONY: test test-package chaos bench mutants kernel run fuzz fuzz-smoke tools deps fetch flavors kvm dkms package help

# $(call sq,VAR): VAR's unexpanded text as one single-quoted shell word, so
# CMD='ip -s link show; echo $$HOME' reaches the guest shell untouched.
sq = '$(subst ','\'',$(value $(1)))'

test:
	@$(LAB) test $(FLAVORS)

test-package:
	@$(LAB) test-package $(FLAVORS)

chaos:
	@$(LAB) chaos $(FLAVORS)

bench:
	@$(LAB) bench $(FLAVORS)

mutants:
	@$(LAB) mutants $(MUTANTS)

kernel:
	@test -n '$(FLAVOR)' || { echo "usage: make kernel FLAVOR=<flavor>  (make flavors lists them)" >&2; exit 2; }
	@$(LAB) kernel $(call sq,FLAVOR) $(if $(REBUILD),--rebuild)

fuzz:
	@test -n '$(FLAVOR)' -a -n '$(DURATION)' || { echo "usage: make fuzz FLAVOR=<fuzz flavor> DURATION=<seconds>  (fuzz flavors: nodrop-6.12-fuzz, nodrop-6.1-fuzz, nodrop-7.3-fuzz, seed-v1-6.12)" >&2; exit 2; }
	@$(LAB) fuzz $(call sq,FLAVOR) --duration $(call sq,DURATION)

fuzz-smoke:
	@$(LAB) fuzz $(or $(FLAVOR),nodrop-6.12-fuzz) --duration $(or $(DURATION),120) --smoke

run:
	@test -n '$(FLAVOR)' || { echo "usage: make run FLAVOR=<flavor> CMD='<shell command>'" >&2; exit 2; }
	@$(LAB) run $(call sq,FLAVOR) -- $(call sq,CMD)

tools deps fetch flavors kvm dkms package:
	@$(LAB) $@

help:
	@sed -n '1,20p' Makefile
