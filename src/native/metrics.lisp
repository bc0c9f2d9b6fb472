;;;; metrics.lisp -- a server's metrics in Prometheus' text format, for a URL
;;;; an app chooses: GALLOP:METRICS-APP is an app, which an app calls for
;;;; that path (the Hunchentoot layer adds its handler and its methods of
;;;; METRICS-TEXT):
;;;;
;;;;   (gallop:start (lambda (env)
;;;;                   (if (string= (getf env :path-info) "/metrics")
;;;;                       (gallop:metrics-app env)
;;;;                       (my-app env))))
;;;;
;;;; The counting is the core's (gallop.core's metrics.lisp).

(in-package #:gallop)

(defgeneric metrics-text (thing)
  (:documentation "The metrics of a running Gallop server, acceptor or
taskmaster in Prometheus' text exposition format 0.0.4 (a string; serve it
as \"text/plain; version=0.0.4; charset=utf-8\"), or NIL when it is not
running.")
  (:method ((server server))
    (let ((engine (server-engine server)))
      (and engine (gallop.core:engine-metrics engine)))))

(defun metrics-app (env)
  "An app that answers with the metrics of the server serving ENV's request
\(METRICS-TEXT), whatever the path: call it from an app for the path
chosen.  Works under Clack's :server :gallop too."
  (let ((c (getf env :gallop.connection)))
    (unless c
      (error "GALLOP:METRICS-APP answers requests of a Gallop server only."))
    (list 200
          (list :content-type gallop.core:+metrics-content-type+
                :cache-control "no-store")
          (list (gallop.core:engine-metrics (gallop.core:connection-engine c))))))
