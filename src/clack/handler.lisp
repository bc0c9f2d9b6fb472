;;;; handler.lisp -- the Clack handler: what (clack:clackup app :server :gallop)
;;;; calls.  Clack calls RUN with the app and its options; RUN serves until its
;;;; thread is destroyed (Clack's STOP does that when :USE-THREAD is true) or
;;;; interrupted, and then stops the server, joining every thread it started.

(defpackage #:clack.handler.gallop
  (:use #:common-lisp)
  (:export #:run))
(in-package #:clack.handler.gallop)

(defun run (app &rest options &key (address "127.0.0.1") (port 5000) debug
                                   (max-thread-count 100) (standby-thread-count 4)
                                   (backlog 1024) &allow-other-keys)
  "Serve the Clack APP on ADDRESS:PORT with Gallop until this thread is
destroyed or interrupted.  Other Clack options are ignored."
  (declare (ignore options))
  (let ((server (gallop:start app :address address :port port :debug debug
                                  :max-thread-count max-thread-count
                                  :standby-thread-count standby-thread-count
                                  :backlog backlog))
        (forever (sb-thread:make-semaphore :name "clack.handler.gallop")))
    (unwind-protect
         (loop (sb-thread:wait-on-semaphore forever))
      (gallop:stop server))))
