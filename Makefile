# Gallop -- the two commands a newcomer needs:
#   make serve   start the example server on http://127.0.0.1:4242/ (Ctrl-C stops it)
#   make test    the deterministic tests, what CI runs (installs what it needs first):
#                pure tests on byte vectors and real servers over real sockets,
#                asserting on what a client receives; no load, no timing
#
# The other test tiers:
#   make test-stress   load, CPU-hog, 10,000-connection and pool-ceiling tests
#                      (system gallop/stress, tests/stress/), then the short soak;
#                      not in CI: run it on a quiet machine before closing an issue
#                      that touches the pool, the event loop or timeouts
#   make bench*        the benchmarks (below)
#
#   make test-restarts the restart drills of test-stress alone: wrk load while
#                      Gallop processes restart (shared port, passed socket, nginx)
#
#   make test-ht13     make test again, against Hunchentoot 1.3.1 (the current release)
#                      instead of Debian's 1.2.38: HUNCHENTOOT_13=DIR names its sources
#                      (Quicklisp's, say); skipped with a line saying so without them;
#                      its compiled files go to .cache/ht13/
#
#   make conformance   the conformance corpus (tests/conformance/) against nginx: a table
#                      of the cases where Gallop and nginx differ (doc/conformance.md)

SHELL := /bin/bash
LISP = scripts/lisp.sh

.PHONY: all deps serve test test-stress test-restarts test-ht13 conformance clean

all: test

deps:
	@scripts/deps.sh

# Debian's .asd files of Hunchentoot and flexi-streams make ASDF warn about
# their test systems' names; those warnings are Debian's, not the example's.
serve: deps
	@$(LISP) --eval '(handler-bind ((warning (lambda (w) (when (search "System definition file" (princ-to-string w)) (muffle-warning w))))) (asdf:load-system "gallop"))' \
	   --load examples/serve.lisp

# Compiler chatter (lines starting with ';') is dropped; the report is kept.
# Tests of libraries Gallop does not ship (Clack, websocket-driver,
# hunchensocket) find them through ASDF -- a source registry such as
# CL_SOURCE_REGISTRY=~/quicklisp/dists/quicklisp/software// -- and are
# skipped, each with its reason, without them.  These are what those
# libraries need from Debian, and the clients the tests use
# (python3-websockets, and Chromium for examples/chat.lisp's page).  The
# metrics tests (tests/production/metrics.lisp) parse the metrics with
# python3-prometheus-client; the access-log tests compare the lines with
# Debian's nginx (tests/production/access-log.lisp; skipped without it).
WS_DEPS = cl-ironclad cl-babel cl-swank cl-trivial-utf-8 cl-global-vars cl-trivial-features \
          cl-trivial-garbage cl-utilities cl-base64 cl-fad cl-ppcre cl-split-sequence \
          cl-trivial-backtrace cl-trivial-gray-streams cl-cffi python3-websockets chromium \
          python3-prometheus-client nginx-light

test: deps
	@scripts/deps.sh $(WS_DEPS)
	@set -o pipefail; \
	 $(LISP) --eval '(asdf:load-system "gallop/tests")' --eval '(gallop-tests:main)' 2>&1 \
	   | grep -av '^;\|^WARNING: System definition file'

# Both parts run whatever the first gave; the target fails if either did.
test-stress: deps
	@scripts/deps.sh wrk slowhttptest
	@set -o pipefail; status=0; \
	 $(LISP) --eval '(asdf:load-system "gallop/stress")' --eval '(gallop-tests:main :stress)' 2>&1 \
	   | grep -av '^;\|^WARNING: System definition file' || status=1; \
	 $(MAKE) --no-print-directory soak-short || status=1; \
	 exit $$status

# The restart drills of make test-stress alone (tests/stress/restart.lisp):
# wrk load while Gallop processes restart, with nginx in front for one.
test-restarts: deps
	@scripts/deps.sh wrk nginx-light
	@set -o pipefail; \
	 $(LISP) --eval '(asdf:load-system "gallop/stress")' --eval '(gallop-tests:main :restarts)' 2>&1 \
	   | grep -av '^;\|^WARNING: System definition file'

HUNCHENTOOT_13 ?=

# A cache of compiled files of its own: ASDF would otherwise reuse Gallop's
# files compiled against the other Hunchentoot.  The run stops before any
# test unless the Hunchentoot loaded is 1.3.1 from HUNCHENTOOT_13.
test-ht13: deps
	@if [ -z "$(HUNCHENTOOT_13)" ] || [ ! -f "$(HUNCHENTOOT_13)/hunchentoot.asd" ]; then \
	   echo "test-ht13: skipped: no Hunchentoot 1.3.1 sources$(if $(HUNCHENTOOT_13), at $(HUNCHENTOOT_13)); set HUNCHENTOOT_13=DIR (its hunchentoot.asd) to run it"; \
	   exit 0; fi; \
	 scripts/deps.sh $(WS_DEPS) && set -o pipefail && \
	 XDG_CACHE_HOME=$(CURDIR)/.cache/ht13 $(LISP) \
	   --eval '(push (truename "$(HUNCHENTOOT_13)/") asdf:*central-registry*)' \
	   --eval '(asdf:load-system "gallop/tests")' \
	   --eval '(gallop-tests:check-hunchentoot-version "1.3.1" (truename "$(HUNCHENTOOT_13)/"))' \
	   --eval '(gallop-tests:main)' 2>&1 \
	   | grep -av '^;\|^WARNING: System definition file'

conformance: deps
	@scripts/deps.sh nginx-light
	@set -o pipefail; \
	 $(LISP) --eval '(asdf:load-system "gallop/tests")' --load tests/conformance/nginx.lisp \
	   --eval '(gallop-tests::nginx-conformance-main)' 2>&1 \
	   | grep -av '^;\|^WARNING: System definition file'

clean:
	rm -rf ~/.cache/common-lisp/sbcl-*$(CURDIR)

# Benchmarks (bench/run.lisp; results and method in BENCHMARKS.md):
#   make bench        the full matrix in both setups (pinned, shared), 3 repetitions, ~40 min;
#                     writes bench/results/RUN.{tsv,md}, BENCHMARKS.md's tables and
#                     BENCHMARKS.svg; then bench-processes (~6 min, below), bench-uploads
#                     and bench-heads (memory under large uploads and partial heads, ~2 min,
#                     below), bench-slow-readers, bench-pending (~1 min) and bench-tls (~20 min)
#   make bench-processes  the many-processes row, shared setup, 5 repetitions, ~6 min:
#                     each Gallop front end in one process and in two on one port
#                     (:reuse-port) against nginx with two workers, 0 ms keep-alive
#                     c100 and c400, req/s and CPU µs/req (all processes summed);
#                     writes bench/results/RUN.{tsv,md} and BENCHMARKS.md's
#                     "Many processes on one port" table
#   make bench-quick  one repetition of 1 s runs, both setups, ~4 min; writes bench/results/tmp/
#   make bench-smoke  seconds-long end-to-end check of the harness (CI); non-zero if broken
# All install wrk and nginx-light first when missing.
BENCH = $(LISP) --load bench/run.lisp --eval

.PHONY: bench bench-quick bench-smoke bench-tls bench-processes

bench:
	@scripts/deps.sh wrk nginx-light
	@$(BENCH) '(gallop-bench:main :full)'
	@$(MAKE) --no-print-directory bench-processes bench-uploads bench-heads bench-slow-readers bench-pending bench-tls

bench-processes:
	@scripts/deps.sh wrk nginx-light
	@$(BENCH) '(gallop-bench:main :processes)'

bench-quick:
	@scripts/deps.sh wrk nginx-light
	@$(BENCH) '(gallop-bench:main :quick)'

bench-smoke:
	@scripts/deps.sh wrk nginx-light
	@$(BENCH) '(gallop-bench:main :smoke)'

# TLS (results in BENCHMARKS.md, "TLS on the event loop"): every server answers HTTPS
# with one self-signed RSA-2048 certificate (nginx with ssl on the same one): wrk
# keep-alive at 10/100/400 connections and Connection: close at 100 (a full handshake
# per request), both setups, 3 repetitions of 5 s (~15 min; writes
# bench/results/RUN.{tsv,md,svg}); then bench/tls-hold.lisp: 10,000 idle TLS
# connections (threads, memory per connection) and 1,000 TLS slowloris clients
# beside a fresh client every 200 ms.
bench-tls:
	@scripts/deps.sh wrk nginx-light
	@$(BENCH) '(gallop-bench:main :tls)'
	@$(MAKE) --no-print-directory bench-tls-hold

# Pending requests (bench/pending.lisp; BENCHMARKS.md, "Pending requests"): cl-async's
# seed test, every request answered 5 s later by a timer (GALLOP:AFTER): wrk -c15000
# against gallop:start; pending requests held, threads, KiB per pending request.
.PHONY: bench-pending
bench-pending:
	@scripts/deps.sh wrk
	@set -o pipefail; \
	 $(LISP) --load bench/pending.lisp --eval '(gallop-bench-pending:main)' 2>&1 \
	   | grep -av '^;\|^WARNING: System definition file'

# WebSockets (bench/websockets.lisp): 10,000 idle, echo rates, a broadcast,
# Gallop's native API, websocket-driver on Clack :gallop and hunchensocket
# on Gallop, beside stock Hunchentoot + hunchensocket, about 10 min.
.PHONY: bench-websockets
bench-websockets: deps
	@scripts/deps.sh gcc $(WS_DEPS)
	@set -o pipefail; \
	 $(LISP) --load bench/websockets.lisp --eval '(gallop-bench-websockets:main)' 2>&1 \
	   | grep -av '^;\|^WARNING: System definition file'
	@set -o pipefail; \
	 $(LISP) --load bench/ws-deflate.lisp --eval '(gallop-bench-ws-deflate:main)' 2>&1 \
	   | grep -av '^;\|^WARNING: System definition file'

.PHONY: bench-tls-hold
bench-tls-hold:
	@set -o pipefail; \
	 $(LISP) --load bench/tls-hold.lisp --eval '(gallop-bench-tls-hold:main)' 2>&1 \
	   | grep -av '^;\|^WARNING: System definition file'

# Soak test (bench/soak.lisp): millions of requests mixing keep-alive, close, slow and
# aborted clients against Gallop's two server kinds; fails when the server's RSS, fds or
# threads grow more than 10% after the warm-up, or it stops answering.
#   make soak        2,000,000 requests per server kind, about 3 min
#   make soak-short  200,000 requests per server kind, under a minute (CI)
# Both install wrk first when missing.
SOAK = $(LISP) --load bench/soak.lisp --eval

.PHONY: soak soak-short

soak:
	@scripts/deps.sh wrk
	@$(SOAK) '(gallop-soak:main :full)'

soak-short:
	@scripts/deps.sh wrk
	@$(SOAK) '(gallop-soak:main :short)'

# Uploads in bounded memory (bench/uploads.lisp): the server's RSS while 8 clients at once
# each upload 50 MiB (Content-Length, chunked in 64 KiB chunks, chunked in one chunk) to a
# handler that reads the body and to one that ignores it; gallop:start, gallop:easy-acceptor
# and, for comparison, stock Hunchentoot, each in its own process.  Non-zero when a row of
# Gallop's rises more than 32 MiB or an answer is wrong.
.PHONY: bench-uploads

bench-uploads:
	@$(LISP) --load bench/uploads.lisp --eval '(gallop-bench-uploads:main)'

# Partial request heads against the head budget (bench/heads.lisp; results in
# BENCHMARKS.md, "Partial heads and the head budget"): 19,000 connections to
# 127.0.0.1 from a client process, each sending a head just short of the
# server's limit without its final empty line (1 MiB; :max-head-bytes 65536;
# :max-head-bytes 16 MiB; and ordinary 4,000-octet heads), against
# gallop:start and gallop:easy-acceptor with SBCL's default heap; each case
# bounded to 180 s.  Non-zero when the server died, answered badly, stopped
# serving, or did not give the budget back.
#   make bench-heads   about 1 min

.PHONY: bench-heads

bench-heads:
	@set -o pipefail; \
	 $(LISP) --load bench/heads.lisp --eval '(gallop-bench-heads:main)' 2>&1 \
	   | grep -av '^;\|^WARNING: System definition file'

# Slow readers (bench/slow-readers.lisp; results in BENCHMARKS.md, "Slow
# readers"): 1,000 clients with 4 KiB receive buffers pipeline GET /yo and
# never read, beside `slowhttptest -X` (500 slow-read connections on the
# 1 MiB /big), while a fresh client asks every 200 ms; gallop:start,
# gallop:easy-acceptor and stock Hunchentoot, each in its own process.
# Non-zero when a Gallop server failed a fresh client, grew past 8 pool
# threads or rose more than 64 MB in RSS.
#   make bench-slow-readers   about 1 min

.PHONY: bench-slow-readers

bench-slow-readers:
	@scripts/deps.sh slowhttptest
	@set -o pipefail; \
	 $(LISP) --load bench/slow-readers.lisp --eval '(gallop-bench-slow-readers:main)' 2>&1 \
	   | grep -av '^;\|^WARNING: System definition file'

# Cheap attacks (bench/attacks.lisp; results in BENCHMARKS.md, "Attacks"):
# connections that send nothing or part of a head, a handler that fails on
# every request, clients that hang up in the middle of a body, slow bodies
# (slowhttptest -B), large uploads, streamed answers nobody reads; WebSocket
# messages that never end, a broadcast to clients that never read, a first
# message on as many held WebSockets as the server takes, silent WebSockets
# at a 256-fd limit, slowhttptest -X on a streamed answer; each against
# gallop:start, gallop:easy-acceptor, stock Hunchentoot and (where it has the
# same thing to do) nginx, each in its own process, beside a fresh client
# asking once a second.  Non-zero when a Gallop row misses its bar.
#   make bench-attacks   about 40 min (ATTACK_CASES, ATTACK_KINDS: a part)

.PHONY: bench-attacks

bench-attacks: deps
	@scripts/deps.sh wrk nginx-light slowhttptest
	@set -o pipefail; \
	 $(LISP) --load bench/attacks.lisp --eval '(gallop-bench-attacks:main)' 2>&1 \
	   | grep -av '^;\|^WARNING: System definition file'
