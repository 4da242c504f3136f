# The same commands as scripts/run.sh (which needs nothing but bash and Python with pip).
# Each target creates .venv with the pinned CPU torch and the package on first use.
.PHONY: bench test publish readme setup clean-venv
ARGS ?=

bench:
	scripts/run.sh bench $(ARGS)

test:
	scripts/run.sh test $(ARGS)

# models tier on trn3 and trn2 into bench/published, then the README table (committed code only)
publish:
	scripts/run.sh publish $(ARGS)

readme:
	scripts/run.sh readme

setup:
	scripts/run.sh setup

clean-venv:
	rm -rf .venv
