;;;; errors.lisp -- what a handler's error costs on a Gallop acceptor: its
;;;; backtrace and its log line, bounded.
;;;;
;;;; Hunchentoot's HANDLE-REQUEST makes a backtrace string of every ERROR a
;;;; handler signals, logged or not, each frame with its arguments printed in
;;;; full, as many frames as the stack holds.  Clients choose how many errors
;;;; there are (a malformed form, a hangup in the middle of a body), so on a
;;;; Gallop acceptor that cost is bounded: at most +BACKTRACE-FRAMES+ frames,
;;;; arguments printed short, GALLOP.CORE:+MAX-LOG-LINE+ characters in all,
;;;; made only when it is logged or shown, for the first
;;;; GALLOP.CORE:+BACKTRACES-PER-SECOND+ errors of a second (one costs
;;;; several error answers; the others are logged with their message); and
;;;; none for a client that went away or timed out, which is the client's
;;;; doing, not a bug to debug (HANDLE-REQUEST in acceptor.lisp).  Every
;;;; message logged on a Gallop connection is cut at the same length
;;;; (ACCEPTOR-LOG-MESSAGE in taskmaster.lisp).  The measurements are in
;;;; doc/design.md, "A handler's error costs a bounded backtrace".

(in-package #:gallop)

(defconstant +backtrace-frames+ 20
  "Frames in the backtrace of a handler's error: the handler's own, the
dispatch, and the request's start; the frames beyond are Gallop's worker.")

(defun bounded-backtrace ()
  "A backtrace of this thread, as Hunchentoot's log and error page show it:
at most +BACKTRACE-FRAMES+ frames, lists, vectors and strings among their
arguments printed to a few elements, at most GALLOP.CORE:+MAX-LOG-LINE+
characters."
  (handler-case
      (gallop.core:cut-log-line
       (with-output-to-string (out)
         (let ((sb-debug:*debug-print-variable-alist*
                 (list* '(*print-length* . 8) '(*print-level* . 3)
                        '(sb-ext:*print-vector-length* . 64) '(*print-circle* . nil)
                        sb-debug:*debug-print-variable-alist*)))
           (sb-debug:print-backtrace :stream out :count +backtrace-frames+
                                     :emergency-best-effort t))))
    (error (condition)
      (format nil "Could not generate backtrace: ~A." condition))))
