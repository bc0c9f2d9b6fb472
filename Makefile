# Gallop -- the two commands a newcomer needs:
#   make serve   start the example server on http://127.0.0.1:4242/ (Ctrl-C stops it)
#   make test    run every test (installs what it needs first)

SHELL := /bin/bash
LISP = scripts/lisp.sh

.PHONY: all deps serve test clean

all: test

deps:
	@scripts/deps.sh

serve: deps
	$(LISP) --load examples/serve.lisp

# Compiler chatter (lines starting with ';') is dropped; the report is kept.
test: deps
	@set -o pipefail; \
	 $(LISP) --eval '(asdf:load-system "gallop/tests")' --eval '(gallop-tests:main)' 2>&1 \
	   | grep -v '^;\|^WARNING: System definition file'

clean:
	rm -rf ~/.cache/common-lisp/sbcl-*$(CURDIR)
