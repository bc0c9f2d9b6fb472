;;;; compat.lisp -- the one place Gallop touches Hunchentoot beyond its
;;;; exported protocol.
;;;;
;;;; Gallop uses Hunchentoot's exported generic functions (START-LISTENING,
;;;; EXECUTE-ACCEPTOR, HANDLE-INCOMING-CONNECTION, PROCESS-CONNECTION,
;;;; INITIALIZE-CONNECTION-STREAM, RESET-CONNECTION-STREAM, SHUTDOWN, STOP ...)
;;;; with one exception, kept here: the listen socket that Hunchentoot's own
;;;; START-LISTENING creates is reachable only through the internal accessor
;;;; ACCEPTOR-LISTEN-SOCKET.  It has the same name and meaning in 1.2.38 and in
;;;; 1.3.x (STOP uses it in both), and the check below makes a Hunchentoot
;;;; that changes it fail at load time rather than at run time.

(in-package #:gallop)

(eval-when (:compile-toplevel :load-toplevel :execute)
  (unless (fboundp (find-symbol "ACCEPTOR-LISTEN-SOCKET" '#:hunchentoot))
    (error "This Hunchentoot has no ACCEPTOR-LISTEN-SOCKET; Gallop needs it ~
            to take over the listen socket.")))

(defun acceptor-listen-usocket (acceptor)
  "The usocket Hunchentoot's START-LISTENING created for ACCEPTOR, or NIL."
  (funcall (find-symbol "ACCEPTOR-LISTEN-SOCKET" '#:hunchentoot) acceptor))
