;;;; in-progress.lisp -- Hunchentoot's count of requests in progress, kept
;;;; without its lock on a Gallop connection.
;;;;
;;;; Hunchentoot's PROCESS-CONNECTION wraps every request in
;;;; DO-WITH-ACCEPTOR-REQUEST-COUNT-INCREMENTED, which takes the acceptor's
;;;; shutdown lock twice (to add one to REQUESTS-IN-PROGRESS, then to take it
;;;; away and, during a stop, signal the shutdown queue), so that a soft
;;;; STOP can wait until the count is zero.  One lock for every request of
;;;; every worker: when the kernel preempts its holder -- beside any other
;;;; busy process on the machine -- the other workers sleep on it while they
;;;; serve, and to the pool they look blocked (doc/design.md, "Hunchentoot's
;;;; request count without its lock").
;;;;
;;;; On a Gallop connection, Gallop's request loop (request-loop.lisp) keeps
;;;; the same count in the same slot with compare-and-swap instead, and takes
;;;; the lock only to signal a stop that waits.  What Hunchentoot's STOP
;;;; reads stays true: it sets SHUTDOWN-P under the lock, then reads the
;;;; count under the lock and waits on the queue while it is above zero; a
;;;; request that ends changes the count first and reads SHUTDOWN-P after.
;;;; Both sides write, then read, with a full barrier between (the CAS here,
;;;; the lock's own CAS there), so at least one sees the other: either STOP
;;;; reads the lower count, or the request sees SHUTDOWN-P and signals --
;;;; under the lock, which STOP holds until it waits, so the signal cannot
;;;; come between STOP's reading of the count and its wait.  The readers of
;;;; the count (1.3.x exports ACCEPTOR-REQUESTS-IN-PROGRESS) read the same
;;;; numbers.

(in-package #:gallop)

(defun add-requests-in-progress (acceptor delta)
  "Add DELTA to ACCEPTOR's count of requests in progress (Hunchentoot's slot,
see compat.lisp), with compare-and-swap."
  (declare (type fixnum delta))
  (let ((slot (load-time-value (requests-in-progress-slot) t)))
    (loop
      (let ((old (slot-value acceptor slot)))
        (declare (type fixnum old))
        (when (eq old (sb-ext:compare-and-swap (slot-value acceptor slot) old (+ old delta)))
          (return))))))

(defun call-counted-request (acceptor function)
  "What Hunchentoot's DO-WITH-ACCEPTOR-REQUEST-COUNT-INCREMENTED does, for a
request on a Gallop connection: call FUNCTION with HUNCHENTOOT:*ACCEPTOR* bound to
ACCEPTOR while ACCEPTOR counts the request in progress."
  (let ((hunchentoot:*acceptor* acceptor))
    ;; Counted once and uncounted once, whatever interrupt comes (a handler
    ;; past its deadline is interrupted, src/core/loop/handler.lisp).
    (sb-sys:without-interrupts
      (unwind-protect
           (progn (add-requests-in-progress acceptor 1)
                  (sb-sys:with-local-interrupts (funcall function)))
        (add-requests-in-progress acceptor -1)
        (when (hunchentoot-shutdown-p acceptor)
          (notify-hunchentoot-shutdown acceptor))))))
