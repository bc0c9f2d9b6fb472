;;;; taskmaster.lisp -- GALLOP:TASKMASTER under Hunchentoot's own acceptors.

(in-package #:gallop-tests)

(def-suite taskmaster :in gallop :description "GALLOP:TASKMASTER on stock acceptors.")
(in-suite taskmaster)

(test taskmaster-on-a-stock-easy-acceptor
  (let ((tm (make-instance 'gallop:taskmaster :max-thread-count 8 :standby-thread-count 3)))
   (with-server (server 'hunchentoot:easy-acceptor :taskmaster tm)
    (is (= 3 (getf (gallop:stats tm) :threads)))
    (let ((socket (connect (port-of server))))
      (unwind-protect
           (dotimes (i 3)
             (send socket (crlf (format nil "GET /yo?name=~D HTTP/1.1" i) "Host: x"))
             (let ((response (read-response socket)))
               (is (= 200 (response-status response)))
               (is (string= (format nil "Hey ~D!" i) (body-string response)))))
        (usocket:socket-close socket)))
    (multiple-value-bind (body status)
        (drakma:http-request (url server "/params") :method :post :parameters '(("a" . "1")))
      (is (= 200 status))
      (is (string= "post a=1 b=NIL" body)))
    (let ((response (get-request (port-of server) "/yo" "Connection: close")))
      (is (= 200 (response-status response)))))))

(test taskmaster-worker-threads-come-from-the-pool
  (with-server (server 'hunchentoot:easy-acceptor
                       :taskmaster (make-instance 'gallop:taskmaster :max-thread-count 4
                                                                     :standby-thread-count 2))
    (let ((names (loop repeat 10
                       collect (body-string (get-request (port-of server) "/thread"
                                                         "Connection: close")))))
      (is (every (lambda (name) (search "worker" name)) names))
      ;; ten connections, no thread per connection
      (is (<= (length (remove-duplicates names :test #'string=)) 4)))))

(test taskmaster-sheds-load-on-a-stock-acceptor
  (with-globals ((*sleep-seconds* 1))
    (with-server (server 'hunchentoot:easy-acceptor
                         :taskmaster (make-instance 'gallop:taskmaster :max-thread-count 1
                                                                       :standby-thread-count 1
                                                                       :max-queue-length 1))
      (let ((responses (read-all-responses (open-requests (port-of server) 8 "/sleep"))))
        (is (every #'response-p responses) "every client got an answer: ~S" responses)
        (is (some (lambda (r) (= 503 (response-status r))) responses))
        (is (some (lambda (r) (= 200 (response-status r))) responses))))))
