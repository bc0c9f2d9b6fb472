;;;; protocol.lisp -- what every child server of the tests shares: the line
;;;; protocol with the test that runs it.  A child server loads this first
;;;; and uses the package GALLOP-CHILD.
;;;;
;;;; The test reads the child's standard output, so the child's own printing
;;;; goes to standard error and only REPLY writes to *PROTOCOL*: a line a
;;;; command ("READY <port>", "STATS <plist>" ...), finished at once.

(defpackage #:gallop-child
  (:use #:common-lisp)
  (:export #:*protocol* #:reply #:child-kind))
(in-package #:gallop-child)

(defvar *protocol* sb-sys:*stdout*)
(setf *standard-output* *error-output*)

(defun reply (control &rest args)
  "Write one line of the protocol, FORMAT's CONTROL with ARGS, and finish it."
  (let ((*print-pretty* nil))
    (format *protocol* "~?~%" control args))
  (finish-output *protocol*))

(defun child-kind ()
  "The server kind the test asked for, the first argument after the
toplevel options, as a keyword (:NATIVE when none was given)."
  (intern (string-upcase (or (second sb-ext:*posix-argv*) "native")) :keyword))
