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

;; 200 while serving, 503 once the process began to stop: for a load
;; balancer's health check.
(hunchentoot:define-easy-handler (ready :uri "/ready") ()
  (gallop:readiness))

(defvar *acceptor*
  (hunchentoot:start (make-instance 'gallop:easy-acceptor
                                    :address "127.0.0.1" :port 8080
                                    :activated-socket t
                                    :access-log-destination *standard-output*)))

;; SIGTERM (systemctl stop or restart): a soft stop, then exit.  Requests
;; that arrived are answered (with Connection: close), those in progress
;; finish (within :stop-timeout, 20 s), and connections that arrive
;; meanwhile wait in gallop.socket's queue for the next process.  Behind a
;; load balancer that polls /ready, :delay keeps serving that long after
;; /ready turned 503.
(gallop:stop-on-sigterm :delay 0)

;; The server's threads do the work; this one waits.
(handler-case (loop (sleep 60))
  (sb-sys:interactive-interrupt () (sb-ext:exit)))
