;;;; start.lisp -- the program gallop.service runs: a Gallop server on the
;;;; socket systemd passes (gallop.socket), or, run by hand, on
;;;; 127.0.0.1:8080 (:activated-socket T takes a passed socket on the port
;;;; asked for when there is one, else binds).

(require :asdf)
(asdf:load-system "gallop")

(defpackage #:app (:use #:common-lisp))
(in-package #:app)

(hunchentoot:define-easy-handler (yo :uri "/yo") ()
  (setf (hunchentoot:content-type*) "text/plain")
  "Hey!")

(defvar *acceptor*
  (hunchentoot:start (make-instance 'gallop:easy-acceptor
                                    :address "127.0.0.1" :port 8080
                                    :activated-socket t
                                    :access-log-destination *standard-output*)))

;; SIGTERM (systemctl stop or restart) makes SBCL exit, which runs the exit
;; hooks: requests in progress finish, then the process ends.  Connections
;; that arrive meanwhile wait in gallop.socket's queue for the next process.
(push (lambda () (hunchentoot:stop *acceptor* :soft t)) sb-ext:*exit-hooks*)

;; The server's threads do the work; this one waits.
(handler-case (loop (sleep 60))
  (sb-sys:interactive-interrupt () (sb-ext:exit)))
