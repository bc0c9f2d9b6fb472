;;;; taskmaster.lisp -- GALLOP:TASKMASTER under Hunchentoot's own acceptors.

(in-package #:gallop-tests)

(def-suite taskmaster :in gallop :description "GALLOP:TASKMASTER on stock acceptors.")
(in-suite taskmaster)

(test taskmaster-on-a-stock-easy-acceptor
  (let ((tm (make-instance 'gallop:taskmaster :max-thread-count 8 :standby-thread-count 3)))
   (with-server (server 'hunchentoot:easy-acceptor :taskmaster tm)
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

;;; Where a request came from.  Hunchentoot asks its usocket for the peer's
;;; and its own address; on a Gallop connection the answer is what accept
;;; gave, on GALLOP:ACCEPTOR and on a stock acceptor alike, so it can't fail
;;; when the client has already hung up.

(hunchentoot:define-easy-handler (handle-peer :uri "/peer") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (format nil "~A ~D ~A ~D" (hunchentoot:remote-addr*) (hunchentoot:remote-port*)
          (hunchentoot:local-addr*) (hunchentoot:local-port*)))

(defun check-peer-names (port)
  "Two requests on one connection to PORT's /peer: each names this client's
address and port and the server's, exactly."
  (let ((socket (connect port)))
    (unwind-protect
         (let ((expected (format nil "127.0.0.1 ~D 127.0.0.1 ~D"
                                 (usocket:get-local-port socket) port)))
           (dotimes (i 2)
             (send socket (crlf "GET /peer HTTP/1.1" "Host: x"))
             (let ((response (read-wire-or-error socket :persistent t)))
               (is (typep response 'wire-response) "~A" response)
               (when (typep response 'wire-response)
                 (is (= 200 (wire-status response)))
                 (is (wire-flag-p response :content-length))
                 (is (equal (princ-to-string (length expected))
                            (wire-header response "Content-Length")))
                 (is (equal expected (wire-body-string response)))))))
      (usocket:socket-close socket))))

(test handlers-see-the-addresses-accept-gave
  ;; Two connections to each server one after the other, then two open at
  ;; once: each sees its own port (Gallop remembers a connection's
  ;; addresses, src/hunchentoot/memo.lisp).
  (flet ((check (port)
           (check-peer-names port)
           (check-peer-names port)
           (let ((other (connect port)))
             (unwind-protect
                  (progn
                    (send other (crlf "GET /peer HTTP/1.1" "Host: x"))
                    (check-peer-names port)
                    (let ((response (read-wire-or-error other :persistent t)))
                      (is (typep response 'wire-response) "~A" response)
                      (when (typep response 'wire-response)
                        (is (equal (format nil "127.0.0.1 ~D 127.0.0.1 ~D"
                                           (usocket:get-local-port other) port)
                                   (wire-body-string response))))))
               (usocket:socket-close other)))))
    (with-server (server 'gallop:easy-acceptor)
      (check (port-of server)))
    (with-server (server 'hunchentoot:easy-acceptor :taskmaster (make-instance 'gallop:taskmaster))
      (check (port-of server)))))

;;; PROCESS-CONNECTION returning without closing its stream (an error before
;;; its own UNWIND-PROTECT, caught and logged by its :AROUND method) must not
;;; leave the connection open for good: only DETACH-SOCKET keeps it.

(defclass failing-connection-acceptor (hunchentoot:easy-acceptor)
  ((failures :initform 0 :accessor acceptor-failures))
  (:documentation "An acceptor whose PROCESS-CONNECTION fails before it
reads anything, on its first connections (while FAILURES is below 3)."))

(defmethod hunchentoot:process-connection :before ((acceptor failing-connection-acceptor) socket)
  (declare (ignore socket))
  (when (< (acceptor-failures acceptor) 3)
    (incf (acceptor-failures acceptor))
    (error "failing before the request loop")))

(test a-connection-hunchentoot-did-not-close-is-closed
  (let ((log (make-string-output-stream)))
    (dolist (taskmaster-p '(t nil))
      (let ((server (if taskmaster-p
                        (make-server 'failing-connection-acceptor
                                     :message-log-destination log
                                     :taskmaster (make-instance 'gallop:taskmaster))
                        (make-server 'gallop-failing-connection-acceptor
                                     :message-log-destination log))))
        (hunchentoot:start server)
        (unwind-protect
             (let ((fds (fd-count)))
               (dotimes (i 3)
                 (let ((socket (connect (port-of server))))
                   (unwind-protect
                        (progn
                          (send socket (crlf "GET /yo HTTP/1.1" "Host: x"))
                          ;; No answer: the server closes (the error is logged).
                          (is (closed-by-peer-p socket) "connection ~D was left open" i))
                     (usocket:socket-close socket))))
               (is (wait-until (lambda () (zerop (stat server :open))))
                   "open after the failures: ~S" (gallop:stats server))
               ;; Then it serves as usual, and nothing leaked.
               (let ((socket (connect (port-of server))))
                 (unwind-protect
                      (progn
                        (send socket (crlf "GET /yo HTTP/1.1" "Host: x" "Connection: close"))
                        (let ((response (read-wire-or-error socket :close t)))
                          (is (typep response 'wire-response) "~A" response)
                          (when (typep response 'wire-response)
                            (is (= 200 (wire-status response)))
                            (is (equal "Hey!" (wire-body-string response))))))
                   (usocket:socket-close socket)))
               (is (wait-until (lambda () (<= (fd-count) fds)) :timeout 5)
                   "fds: ~D before, ~D after" fds (fd-count)))
          (hunchentoot:stop server))))
    (let ((text (get-output-stream-string log)))
      (is (= 6 (count-matches "failing before the request loop" text))
          "each failure logged once:~%~A" text))))

(defclass gallop-failing-connection-acceptor (gallop:easy-acceptor failing-connection-acceptor)
  ()
  (:documentation "FAILING-CONNECTION-ACCEPTOR on GALLOP:EASY-ACCEPTOR."))
