;;;; start.lisp -- a Gallop server, as gallop@.service runs it or by hand:
;;;;
;;;;   sbcl --script examples/deploy/start.lisp [PORT [ACCESS-LOG]]
;;;;
;;;; It serves on 127.0.0.1:PORT (8080; 0: any free port), or on the socket
;;;; systemd passes for that port (gallop@PORT.socket: Gallop takes a passed
;;;; socket on the port it asks for, and refuses to start if none is on
;;;; it).  Its app answers / with "Hey!", /ready with the readiness a load
;;;; balancer polls, and /metrics with Prometheus' text format; every answer
;;;; is a line in ACCESS-LOG (access.log in the working directory), in
;;;; nginx's combined format.  SIGHUP opens the access log again by its
;;;; name (logrotate); SIGTERM stops softly, then exits with status 0.
;;;; Once it listens it prints one line: "Serving http://ADDRESS:PORT/".

(require :asdf)

;; Gallop as ASDF is configured to find it (CL_SOURCE_REGISTRY,
;; ~/common-lisp/), or else from the checkout this file is part of.
(unless (asdf:find-system "gallop/native" nil)
  (asdf:load-asd (merge-pathnames "../../gallop.asd"
                                  (make-pathname :name nil :type nil
                                                 :defaults *load-truename*))))
(let ((*compile-verbose* nil) (*compile-print* nil))
  (asdf:load-system "gallop/native"))

(defpackage #:deploy-example (:use #:common-lisp))
(in-package #:deploy-example)

(defvar *port* (parse-integer (or (second sb-ext:*posix-argv*) "8080")))
(defvar *access-log* (or (third sb-ext:*posix-argv*) "access.log"))

(defun app (env)
  (let ((path (getf env :path-info)))
    (cond ((string= path "/ready") (gallop:readiness-response env))
          ;; Behind nginx, which refuses /metrics to the outside
          ;; (nginx.conf): Prometheus scrapes 127.0.0.1:PORT/metrics.
          ((string= path "/metrics") (gallop:metrics-app env))
          ((string= path "/") '(200 (:content-type "text/plain") ("Hey!")))
          (t '(404 (:content-type "text/plain") ("Not found"))))))

;; SIGHUP (logrotate's postrotate, systemctl reload): open the access log
;; again by its name.  SBCL's default on SIGHUP is to exit.
(gallop:reopen-logs-on-sighup)

;; SIGTERM (systemctl stop or restart): a soft stop, then exit 0.  Requests
;; that arrived are answered (with Connection: close), those in progress
;; finish (within :stop-timeout, 20 s), and connections that arrive
;; meanwhile wait in gallop@PORT.socket's queue for the next process.
;; Behind a load balancer that polls /ready, :delay keeps serving that long
;; after /ready turned 503.
(gallop:stop-on-sigterm :delay 0)

(defvar *server*
  (handler-case (gallop:start #'app :address "127.0.0.1" :port *port*
                                    :access-log *access-log* :access-log-format :combined)
    ;; One line in the journal, not a backtrace: the port taken, a passed
    ;; socket on another port, an access log it cannot open.
    (error (e)
      (format *error-output* "Cannot start: ~A~%" e)
      (sb-ext:exit :code 1 :abort t))))

(format t "Serving http://~A:~D/~%" (gallop:server-address *server*)
        (gallop:server-port *server*))
(finish-output)

;; The server's threads do the work; this one waits.
(handler-case (loop (sleep 60))
  (sb-sys:interactive-interrupt () (sb-ext:exit)))
