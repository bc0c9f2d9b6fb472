;;;; suite.lisp -- the suite of `make test-stress` (system gallop/stress):
;;;; load, CPU hogs, thousands of connections and the pool's ceilings.
;;;;
;;;; These tests assert on what `make test` must not: threads and run
;;;; permits under load, context switches, behaviour beside a busy loop.
;;;; Where a bound can come from a control, the control is measured in the
;;;; same run (the same server capped, stock Hunchentoot); the other bounds
;;;; are the pool's documented rules (README, "Settings"), never a constant
;;;; tuned on one host.  Not part of CI: run it on a quiet machine before
;;;; closing an issue that touches the pool, the event loop or timeouts.

(in-package #:gallop-tests)

(def-suite stress :description "Gallop under load: `make test-stress`.")
