;;;; metrics.lisp -- an acceptor's metrics in Prometheus' text format, as a
;;;; Hunchentoot handler mounted where one chooses:
;;;;
;;;;   (push (gallop:create-metrics-dispatcher "/metrics") hunchentoot:*dispatch-table*)
;;;;   ;; or
;;;;   (hunchentoot:define-easy-handler (metrics :uri "/metrics") ()
;;;;     (gallop:metrics-handler))
;;;;
;;;; For any acceptor Gallop serves: its own classes, or a stock acceptor
;;;; with GALLOP:TASKMASTER.  The counting is the core's (gallop.core's
;;;; metrics.lisp); the answers Hunchentoot writes are counted in
;;;; WRITE-RESPONSE (heads.lisp).

(in-package #:gallop)

(defmethod metrics-text ((tm taskmaster))
  (let ((engine (taskmaster-engine tm)))
    (and engine (gallop.core:engine-metrics engine))))

(defmethod metrics-text ((acceptor hunchentoot:acceptor))
  (let ((tm (acceptor-gallop-taskmaster acceptor)))
    (and tm (metrics-text tm))))

(defun metrics-handler ()
  "A Hunchentoot handler: the metrics of the acceptor serving the current
request (HUNCHENTOOT:*ACCEPTOR*, METRICS-TEXT) in Prometheus' text format
0.0.4, or 503 when Gallop does not serve it."
  (setf (hunchentoot:header-out :cache-control) "no-store")
  (let ((text (metrics-text hunchentoot:*acceptor*)))
    (cond (text
           (setf (hunchentoot:content-type*) gallop.core:+metrics-content-type+)
           text)
          (t
           (setf (hunchentoot:content-type*) "text/plain; charset=utf-8"
                 (hunchentoot:return-code*) hunchentoot:+http-service-unavailable+)
           (format nil "This acceptor is not served by Gallop.~%")))))

(defun create-metrics-dispatcher (path)
  "A dispatcher for HUNCHENTOOT:*DISPATCH-TABLE* (or an acceptor's own) that
answers a request for PATH, exactly, with METRICS-HANDLER."
  (lambda (request)
    (and (string= (hunchentoot:script-name request) path)
         #'metrics-handler)))
