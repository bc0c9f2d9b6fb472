;;;; requests.lisp -- Hunchentoot handlers, unchanged, on GALLOP:EASY-ACCEPTOR:
;;;; what a client sees on the wire.

(in-package #:gallop-tests)

(def-suite requests :in gallop :description "HTTP requests through the drop-in acceptor.")
(in-suite requests)

(test keep-alive-serves-several-requests-on-one-connection
  (with-server (server 'gallop:easy-acceptor)
    (let ((socket (connect (port-of server))))
      (unwind-protect
           (dotimes (i 5)
             (send socket (crlf (format nil "GET /yo?name=n~D HTTP/1.1" i) "Host: x"))
             (let ((response (read-response socket)))
               (is (= 200 (response-status response)))
               (is (string= (format nil "Hey n~D!" i) (body-string response)))
               (is (not (equalp "close" (header response "Connection"))))))
        (usocket:socket-close socket)))
    ;; The connection waited in epoll between requests, holding no worker.
    (is (= 1 (stat server :accepted)))
    (is (<= 5 (stat server :requests)))))

(test connection-close-is-honoured
  (with-server (server 'gallop:easy-acceptor)
    (let ((socket (connect (port-of server))))
      (unwind-protect
           (progn
             (send socket (crlf "GET /yo HTTP/1.1" "Host: x" "Connection: close"))
             (let ((response (read-response socket)))
               (is (= 200 (response-status response)))
               (is (string= "Hey!" (body-string response))))
             (is (closed-by-peer-p socket)))
        (usocket:socket-close socket)))))

(test http-1.0-closes-unless-keep-alive-is-asked-for
  (with-server (server 'gallop:easy-acceptor)
    (let ((socket (connect (port-of server))))
      (unwind-protect
           (progn
             (send socket (crlf "GET /yo HTTP/1.0"))
             (let ((response (read-response socket)))
               (is (= 200 (response-status response)))
               (is (string= "Hey!" (body-string response))))
             (is (closed-by-peer-p socket)))
        (usocket:socket-close socket)))
    (let ((socket (connect (port-of server))))
      (unwind-protect
           (progn
             (dotimes (i 2)
               (send socket (crlf "GET /yo HTTP/1.0" "Connection: Keep-Alive"))
               (let ((response (read-response socket)))
                 (is (= 200 (response-status response)))
                 (is (string= "Hey!" (body-string response))))))
        (usocket:socket-close socket)))))

(test pipelined-requests-are-answered-in-order
  (with-server (server 'gallop:easy-acceptor)
    (let ((socket (connect (port-of server))))
      (unwind-protect
           (progn
             (send socket (concatenate 'string
                                       (crlf "GET /yo?name=one HTTP/1.1" "Host: x")
                                       (crlf "GET /yo?name=two HTTP/1.1" "Host: x")
                                       (crlf "GET /yo?name=three HTTP/1.1" "Host: x")))
             (dolist (name '("one" "two" "three"))
               (let ((response (read-response socket)))
                 (is (= 200 (response-status response)))
                 (is (string= (format nil "Hey ~A!" name) (body-string response))))))
        (usocket:socket-close socket)))))

(test request-head-split-across-packets
  (with-server (server 'gallop:easy-acceptor)
    (let ((socket (connect (port-of server)))
          (text (crlf "GET /yo?name=slow HTTP/1.1" "Host: x" "X-Padding: abcdefghij")))
      (unwind-protect
           (progn
             (loop for start from 0 below (length text) by 7
                   do (send socket (subseq text start (min (length text) (+ start 7))))
                      (sleep 0.01))
             (let ((response (read-response socket)))
               (is (= 200 (response-status response)))
               (is (string= "Hey slow!" (body-string response)))))
        (usocket:socket-close socket)))))

(test get-and-post-parameters
  (with-server (server 'gallop:easy-acceptor)
    (multiple-value-bind (body status)
        (drakma:http-request (url server "/params?a=1&b=two"))
      (is (= 200 status))
      (is (string= "get a=1 b=two" body)))
    (multiple-value-bind (body status)
        (drakma:http-request (url server "/params") :method :post
                                                    :parameters '(("a" . "x y") ("b" . "&=")))
      (is (= 200 status))
      (is (string= "post a=x y b=&=" body)))))

(test post-body-with-content-length
  (with-server (server 'gallop:easy-acceptor)
    (let* ((payload (make-string 20000 :initial-element #\q))
           (response (request (port-of server)
                              (concatenate 'string
                                           (crlf "POST /body HTTP/1.1" "Host: x"
                                                 "Content-Type: application/octet-stream"
                                                 (format nil "Content-Length: ~D" (length payload)))
                                           payload))))
      (is (= 200 (response-status response)))
      (is (string= (format nil "20000:~A" payload) (body-string response))))))

(test post-body-chunked
  (with-server (server 'gallop:easy-acceptor)
    (let ((response (request (port-of server)
                             (concatenate 'string
                                          (crlf "POST /body HTTP/1.1" "Host: x"
                                                "Content-Type: application/octet-stream"
                                                "Transfer-Encoding: chunked")
                                          (format nil "5~C~Chello~C~C6~C~C world~C~C0~C~C~C~C"
                                                  #\Return #\Linefeed #\Return #\Linefeed
                                                  #\Return #\Linefeed #\Return #\Linefeed
                                                  #\Return #\Linefeed #\Return #\Linefeed)))))
      (is (= 200 (response-status response)))
      (is (string= "11:hello world" (body-string response))))))

(test one-megabyte-response
  (with-server (server 'gallop:easy-acceptor)
    (multiple-value-bind (body status)
        (drakma:http-request (url server "/big") :force-binary t)
      (is (= 200 status))
      (is (= *big-size* (length body)))
      (is (loop for i below (length body) always (= (aref body i) (mod i 251)))))))

(test chunked-response-streamed-by-the-handler
  (with-server (server 'gallop:easy-acceptor)
    (let ((socket (connect (port-of server))))
      (unwind-protect
           (dotimes (i 2)
             (send socket (crlf "GET /chunked HTTP/1.1" "Host: x"))
             (let ((response (read-response socket)))
               (is (= 200 (response-status response)))
               (is (equalp "chunked" (header response "Transfer-Encoding")))
               (is (string= "part 0;part 1;part 2;part 3;part 4;" (body-string response)))))
        (usocket:socket-close socket)))))

(test cookies-and-sessions
  (with-server (server 'gallop:easy-acceptor)
    (let ((jar (make-instance 'drakma:cookie-jar)))
      (dotimes (i 3)
        (multiple-value-bind (body status)
            (drakma:http-request (url server "/counter") :cookie-jar jar)
          (is (= 200 status))
          (is (string= (princ-to-string (1+ i)) body))))
      (is (find "seen" (drakma:cookie-jar-cookies jar) :key #'drakma:cookie-name
                                                        :test #'string=)))
    (is (string= "vanilla"
                 (body-string (get-request (port-of server) "/cookie" "Cookie: flavour=vanilla"))))))

(test handler-error-gives-500-and-the-worker-lives-on
  (let ((log (make-string-output-stream)))
    (with-server (server 'gallop:easy-acceptor
                         :message-log-destination log
                         :taskmaster (make-instance 'gallop:taskmaster
                                                    :max-thread-count 1
                                                    :standby-thread-count 1))
      (let ((socket (connect (port-of server))))
        (unwind-protect
             (progn
               (send socket (crlf "GET /fail HTTP/1.1" "Host: x"))
               (is (= 500 (response-status (read-response socket))))
               (send socket (crlf "GET /thread HTTP/1.1" "Host: x"))
               (let ((response (read-response socket)))
                 (is (= 200 (response-status response)))))
          (usocket:socket-close socket)))
      (is (= 200 (response-status (get-request (port-of server) "/yo")))))
    ;; Logged once.
    (let ((text (get-output-stream-string log)))
      (is (= 1 (count-matches "deliberate test error" text))))))

(test stack-exhaustion-in-a-handler-leaves-the-server-serving
  ;; SBCL signals a STORAGE-CONDITION, not an ERROR: it must not escape to
  ;; the worker thread (which would end the process without a debugger).
  (with-server (server 'gallop:easy-acceptor)
    (is (= 500 (response-status (get-request (port-of server) "/deep"))))
    (is (= 200 (response-status (get-request (port-of server) "/yo"))))
    ;; and the worker that hit it is back in the pool
    (is (wait-until (lambda () (zerop (stat server :in-flight)))))))
