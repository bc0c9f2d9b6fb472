;;;; serve.lisp -- the example server of `make serve`: Gallop's drop-in
;;;; easy-acceptor on http://127.0.0.1:4242/ with /yo, a demo page,
;;;; /gallop/status and /gallop/metrics (Prometheus' text format); beside it,
;;;; on http://127.0.0.1:4243/, the native API's WebSockets
;;;; (examples/chat.lisp): an echo at /ws/echo, a chat page at /chat, and its
;;;; own /gallop/metrics.  Logs to standard output; Ctrl-C stops both.

(asdf:load-system "gallop")
(load (merge-pathnames "chat.lisp" (or *load-truename* *default-pathname-defaults*)))

(defpackage #:gallop-example
  (:use #:common-lisp))
(in-package #:gallop-example)

(hunchentoot:define-easy-handler (yo :uri "/yo") (name)
  (setf (hunchentoot:content-type*) "text/plain")
  (format nil "Hey~@[ ~A~]!" name))

(hunchentoot:define-easy-handler (sleepy :uri "/sleep") ((ms :parameter-type 'integer))
  (setf (hunchentoot:content-type*) "text/plain")
  (sleep (/ (or ms 100) 1000))
  (format nil "Slept ~D ms.~%" (or ms 100)))

(defvar *acceptor*)

(hunchentoot:define-easy-handler (status :uri "/gallop/status") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (format nil "~{~(~A~): ~A~%~}" (gallop:stats *acceptor*)))

(hunchentoot:define-easy-handler (metrics :uri "/gallop/metrics") ()
  (gallop:metrics-handler))

(hunchentoot:define-easy-handler (home :uri "/") ()
  (setf (hunchentoot:content-type*) "text/html")
  (hunchentoot:start-session)
  (let ((visits (setf (hunchentoot:session-value :visits)
                      (1+ (or (hunchentoot:session-value :visits) 0)))))
    (format nil "<!doctype html>
<html><head><title>Gallop</title></head>
<body style='font-family: sans-serif; max-width: 40em; margin: 2em auto'>
<h1>Gallop is serving</h1>
<p>A stock Hunchentoot easy-handler, served by <code>gallop:easy-acceptor</code>:
idle connections wait in epoll, requests run on an elastic pool of threads.</p>
<p>You have loaded this page ~D time~:P in this session.</p>
<ul>
<li><a href='/yo?name=you'>/yo?name=you</a> - the benchmark handler</li>
<li><a href='/sleep?ms=250'>/sleep?ms=250</a> - a handler that blocks for 250 ms</li>
<li><a href='/gallop/status'>/gallop/status</a> - connection and pool statistics</li>
<li><a href='/gallop/metrics'>/gallop/metrics</a> - the same, and requests by status and
duration, in Prometheus' text format (the chat server's:
<a href='http://127.0.0.1:4243/gallop/metrics'>http://127.0.0.1:4243/gallop/metrics</a>)</li>
<li><a href='http://127.0.0.1:4243/chat'>http://127.0.0.1:4243/chat</a> - a WebSocket chat
on the native API (echo: ws://127.0.0.1:4243/ws/echo)</li>
</ul>
<form method='post' action='/yo'><input name='name' placeholder='your name'>
<button>POST to /yo</button></form>
</body></html>" visits)))

;; Sessions sign their cookies with this secret; set it before the first
;; session, or Hunchentoot warns and makes one up on the fly.
(hunchentoot:reset-session-secret)

(setf *acceptor* (make-instance 'gallop:easy-acceptor
                                :address "127.0.0.1" :port 4242
                                :access-log-destination *standard-output*
                                :message-log-destination *standard-output*))
(hunchentoot:start *acceptor*)
(defvar *chat* (gallop-example-chat:main :port 4243))
(format t "~&Gallop is serving on http://127.0.0.1:4242/, and a WebSocket chat on ~
           http://127.0.0.1:4243/chat (Ctrl-C stops it)~%")
(finish-output)

(handler-case
    (loop (sleep 3600))
  (sb-sys:interactive-interrupt ()
    (format t "~&Stopping...~%")
    (hunchentoot:stop *acceptor* :soft t)
    (gallop:stop *chat* :soft t)
    (format t "Stopped.~%")
    (uiop:quit 0)))
