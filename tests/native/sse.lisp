;;;; sse.lisp -- examples/sse.lisp with 100 clients: every client receives
;;;; every event, in order, in a well-formed chunked text/event-stream
;;;; answer.

(in-package #:gallop-tests)

(in-suite native)

(eval-when (:compile-toplevel :load-toplevel :execute)
  (load (merge-pathnames "examples/sse.lisp" (asdf:system-source-directory "gallop"))))

(defparameter *sse-events* 5)

(defun check-sse-clients (clients)
  "CLIENTS connections to examples/sse.lisp's /events each receive all
*SSE-EVENTS* events, in order, in a well-formed chunked answer."
  (raise-fd-limit (+ 1000 (* 3 clients)))
  (gallop-example-sse:forget-clients)
  (with-app (server #'gallop-example-sse:events-app :standby-thread-count 4)
    (let ((sockets '())
          (expected (format nil "~{id: ~D~%data: tick ~:*~D~%~%~}"
                            (loop for i from 1 to *sse-events* collect i))))
      (unwind-protect
           (progn
             (setf sockets (open-requests (native-port server) clients "/events"))
             (is (wait-until (lambda () (= clients (gallop-example-sse:client-count))))
                 "~D of ~D clients registered" (gallop-example-sse:client-count) clients)
             (gallop-example-sse:tick-every 0.1 server :count *sse-events*)
             (let ((good 0) (first-bad nil))
               (dolist (socket sockets)
                 (let ((response (read-wire-or-error socket :persistent t)))
                   (if (and (typep response 'wire-response)
                            (= 200 (wire-status response))
                            (equal "text/event-stream" (wire-header response "Content-Type"))
                            (wire-flag-p response :chunked)
                            (equal expected (wire-body-string response)))
                       (incf good)
                       (unless first-bad (setf first-bad response)))))
               (is (= clients good) "~D of ~D got every event in order; one: ~A"
                   good clients first-bad)))
        (mapc #'usocket:socket-close sockets)))
    (is (wait-until (lambda () (zerop (getf (gallop:stats server) :in-flight)))))))

(test server-sent-events-reach-every-client-in-order
  "100 clients here; 1,000 in `make test-stress`."
  (check-sse-clients 100))

(test a-writer-of-a-client-that-went-away-answers-nil
  ;; The client resets; the next writes find it gone: NIL, nothing logged.
  (let ((log (make-string-output-stream))
        (writers (sb-concurrency:make-mailbox)))
    (flet ((app (env)
             (declare (ignore env))
             (lambda (responder)
               (sb-concurrency:send-message
                writers (funcall responder '(200 (:content-type "text/event-stream")))))))
      (with-app (server #'app :log log)
        (let ((socket (connect (native-port server))))
          (send socket (crlf "GET /events HTTP/1.1" "Host: x"))
          (let ((writer (sb-concurrency:receive-message writers :timeout 5)))
            (is (eq t (funcall writer (format nil "data: one~%~%"))))
            (abort-connection socket :reset)
            (is (wait-until (lambda () (null (funcall writer (format nil "data: more~%~%"))))
                            :timeout 5)
                "the writer still answers T after the client reset")
            (is (null (funcall writer (format nil "data: last~%~%") :close t)))))
        (is (wait-until (lambda () (zerop (getf (gallop:stats server) :open))))))
      (is (zerop (length (get-output-stream-string log)))))))
