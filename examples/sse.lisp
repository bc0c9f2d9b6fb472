;;;; sse.lisp -- server-sent events on the native API: one event a second
;;;; to every connected client, and no thread per client.
;;;;
;;;;   scripts/lisp.sh --load examples/sse.lisp --eval '(gallop-example-sse:main)'
;;;;   curl -N http://127.0.0.1:4243/events
;;;;
;;;; Each client's answer is a streamed text/event-stream body (chunked): the
;;;; app keeps its writer (from the responder) in *CLIENTS* and returns; its
;;;; connection waits in the engine, not in a worker.  A timer (GALLOP:AFTER)
;;;; fires every second on a worker and writes the event to every writer; a
;;;; writer that answers NIL belongs to a client that went away, and is
;;;; dropped.  (tests/native/sse.lisp runs this file with 1,000 clients.)

(unless (find-package "GALLOP")         ; (loaded already by the tests)
  (asdf:load-system "gallop/native"))

(defpackage #:gallop-example-sse
  (:use #:common-lisp)
  (:export #:events-app #:broadcast #:tick-every #:client-count #:forget-clients #:main))
(in-package #:gallop-example-sse)

(defvar *clients* '()
  "The writers of the connected clients.")

(defvar *lock* (sb-thread:make-mutex :name "sse clients"))

(defun events-app (env)
  "GET /events: an event stream that BROADCAST writes to."
  (if (string= (getf env :path-info) "/events")
      (lambda (responder)
        (let ((writer (funcall responder '(200 (:content-type "text/event-stream"
                                                :cache-control "no-cache")))))
          (sb-thread:with-mutex (*lock*)
            (push writer *clients*))))
      '(404 (:content-type "text/plain") ("Not found"))))

(defun client-count ()
  (sb-thread:with-mutex (*lock*) (length *clients*)))

(defun forget-clients ()
  (sb-thread:with-mutex (*lock*) (setf *clients* '())))

(defun broadcast (id data &key last)
  "Send the event ID with DATA (one line) to every client, and with LAST end
their streams; drop the clients that went away."
  (let ((event (format nil "id: ~D~%data: ~A~%~%" id data))
        (writers (sb-thread:with-mutex (*lock*)
                   (if last (shiftf *clients* '()) (copy-list *clients*)))))
    (dolist (writer writers)
      (unless (funcall writer event :close last)
        (sb-thread:with-mutex (*lock*)
          (setf *clients* (delete writer *clients*)))))))

(defun tick-every (seconds server &key count (id 1))
  "Broadcast \"tick ID\" now, then every SECONDS from a timer on a worker of
SERVER: COUNT events in all (the last ends the streams), or for ever."
  (let ((last (and count (>= id count))))
    (broadcast id (format nil "tick ~D" id) :last last)
    (unless last
      (gallop:after seconds (lambda () (tick-every seconds server :count count :id (1+ id)))
                    :server server))))

(defun main (&key (port 4243))
  (let ((server (gallop:start #'events-app :port port)))
    (tick-every 1 server)
    (format t "~&Server-sent events on http://127.0.0.1:~D/events (Ctrl-C stops)~%" port)
    (handler-case (loop (sleep 60))
      (sb-sys:interactive-interrupt () (gallop:stop server)))))
