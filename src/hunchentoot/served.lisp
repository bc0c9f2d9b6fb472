;;;; served.lisp -- SERVED-ACCEPTOR, the class Gallop's methods on
;;;; Hunchentoot's acceptor protocol are specialised on.
;;;;
;;;; What Gallop adds around Hunchentoot's request handling on a Gallop
;;;; connection (request boundaries, keep/close, bodies left unread, bounded
;;;; log lines, a soft stop's last requests) are methods on Hunchentoot's
;;;; generic functions, and they are specialised on this class, never on
;;;; HUNCHENTOOT:ACCEPTOR alone: an acceptor Gallop does not serve runs
;;;; Hunchentoot's own methods only.  (The request loop, PROCESS-CONNECTION,
;;;; is specialised on Gallop's socket class instead: request-loop.lisp.)
;;;;
;;;; GALLOP:ACCEPTOR and its variants inherit it.  A stock acceptor given a
;;;; GALLOP:TASKMASTER becomes one when the taskmaster starts it: its class
;;;; is changed to a subclass of its own class and this one (SERVE-WITH-
;;;; GALLOP), which it keeps.  In either case this class comes right after
;;;; HUNCHENTOOT:ACCEPTOR in the precedence list, where Gallop's methods
;;;; would be if they were on HUNCHENTOOT:ACCEPTOR: the methods of the
;;;; user's classes and Hunchentoot's before it run inside Gallop's :AROUND
;;;; methods, those of mixins after it outside.  Why the class is changed
;;;; (five of the methods have only the acceptor to dispatch on), and what
;;;; that costs: doc/design.md, "A stock acceptor's class is changed".

(in-package #:gallop)

(defclass served-acceptor ()
  ()
  (:documentation "An acceptor whose connections a Gallop engine serves:
Gallop's methods on Hunchentoot's acceptor protocol apply to it (see
served.lisp)."))

(defvar *connection* nil
  "The Gallop connection the current worker is serving, if any.")

(defvar *requests-ended* nil
  "Bound to NIL for each run of the request loop on a Gallop connection
\(PROCESS-GALLOP-CONNECTION); true once Gallop's loop (SERVE-REQUESTS) found
no further request there, the way it ends when the connection is kept.")

(defun request-connection ()
  "The Gallop connection Hunchentoot reads the current request through,
whose state says where that request is (head or body left, close after):
*CONNECTION* itself, or on TLS the plaintext connection over its TLS stream
\(see gallop.core's tls.lisp), since *CONNECTION* carries only ciphertext."
  (let ((owner (and *connection* (connection-owner-stream *connection*))))
    (if (typep owner 'gallop.core:connection) owner *connection*)))

(defvar *served-classes* (make-hash-table :test 'eq :weakness :key :synchronized t)
  "Each stock acceptor class a GALLOP:TASKMASTER started an instance of -> the
subclass of it and SERVED-ACCEPTOR that instance was changed to.")

(defun served-superclasses (class)
  "The direct superclasses of CLASS's served subclass: CLASS's precedence list
up to STANDARD-OBJECT, with SERVED-ACCEPTOR right after HUNCHENTOOT:ACCEPTOR.
Named in full so that a mixin the user listed after a Hunchentoot class
still comes after SERVED-ACCEPTOR, as it does on a GALLOP:ACCEPTOR."
  (sb-mop:finalize-inheritance class)
  (let ((base (sb-mop:class-precedence-list (find-class 'standard-object))))
    (loop for super in (sb-mop:class-precedence-list class)
          until (member super base)
          collect super
          when (eq super (find-class 'hunchentoot:acceptor))
            collect (find-class 'served-acceptor))))

(defun served-class (class)
  "The subclass of CLASS (a Hunchentoot acceptor class) and SERVED-ACCEPTOR,
made once per class with CLASS's metaclass, and named GALLOP::|SERVED
package:name|."
  (sb-ext:with-locked-hash-table (*served-classes*)
    (or (gethash class *served-classes*)
        (setf (gethash class *served-classes*)
              (let* ((name (intern (format nil "SERVED ~A"
                                           (let ((*package* (find-package :keyword)))
                                             (prin1-to-string (class-name class))))
                                   '#:gallop))
                     (served (make-instance (class-of class)
                                            :name name
                                            :direct-superclasses (served-superclasses class))))
                (sb-mop:finalize-inheritance served)
                (setf (find-class name) served))))))

(defun serve-with-gallop (acceptor)
  "Make ACCEPTOR a SERVED-ACCEPTOR, if it is not one yet: its class becomes
\(SERVED-CLASS of its class).  Called before any of its connections is
served, so that no other thread is using it.  (CHANGE-CLASS runs the
acceptor's SHARED-INITIALIZE methods again, with no initargs.)"
  (unless (typep acceptor 'served-acceptor)
    (change-class acceptor (served-class (class-of acceptor))))
  acceptor)
