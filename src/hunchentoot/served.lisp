;;;; served.lisp -- SERVED-ACCEPTOR, the class Gallop's methods on
;;;; Hunchentoot's acceptor protocol are specialised on.
;;;;
;;;; Hunchentoot's request loop runs unchanged on a Gallop connection; what
;;;; Gallop adds around it (request boundaries, keep/close, bodies left
;;;; unread, bounded log lines, a soft stop's last requests) are methods on
;;;; Hunchentoot's generic functions, and they are specialised on this class,
;;;; never on HUNCHENTOOT:ACCEPTOR: an acceptor Gallop does not serve runs
;;;; Hunchentoot's own methods only.
;;;;
;;;; GALLOP:ACCEPTOR and its variants inherit it.  A stock acceptor given a
;;;; GALLOP:TASKMASTER becomes one when the taskmaster starts it: its class
;;;; is changed to a subclass of its own class and this one (SERVE-WITH-
;;;; GALLOP), which it keeps.  This class comes last among Hunchentoot's
;;;; acceptor classes in either case, so that the user's methods and
;;;; Hunchentoot's run inside Gallop's :AROUND methods, as they would around
;;;; any method of HUNCHENTOOT:ACCEPTOR.

(in-package #:gallop)

(defclass served-acceptor ()
  ()
  (:documentation "An acceptor whose connections a Gallop engine serves:
Gallop's methods on Hunchentoot's acceptor protocol apply to it (see
served.lisp)."))

(defvar *served-classes* (make-hash-table :test 'eq :weakness :key :synchronized t)
  "Each stock acceptor class a GALLOP:TASKMASTER started an instance of -> the
subclass of it and SERVED-ACCEPTOR that instance was changed to.")

(defun served-class (class)
  "The subclass of CLASS (a Hunchentoot acceptor class) and SERVED-ACCEPTOR,
made once per class, with CLASS's metaclass."
  (or (gethash class *served-classes*)
      (setf (gethash class *served-classes*)
            (let ((served (make-instance (class-of class)
                                         :name (make-symbol (format nil "~A (SERVED BY GALLOP)"
                                                                    (class-name class)))
                                         :direct-superclasses
                                         (list class (find-class 'served-acceptor)))))
              (sb-mop:finalize-inheritance served)
              served))))

(defun serve-with-gallop (acceptor)
  "Make ACCEPTOR a SERVED-ACCEPTOR, if it is not one yet: its class becomes
\(SERVED-CLASS of its class).  Called before any of its connections is
served, so that no other thread is using it."
  (unless (typep acceptor 'served-acceptor)
    (change-class acceptor (served-class (class-of acceptor))))
  acceptor)
