;;;; connections.lisp -- slow clients and timeouts on the drop-in acceptor:
;;;; a client that stops reading, a body that stops arriving, idle TLS
;;;; connections timing out, streams handed to the handler.  (Thousands of
;;;; idle and slowloris connections: tests/stress/connections.lisp.)

(in-package #:gallop-tests)

(def-suite connections :in gallop :description "Event-driven connections.")
(in-suite connections)

(defun raise-test-fd-limit ()
  (gallop.core:raise-fd-limit))

(test a-client-that-stops-reading-does-not-pin-a-worker
  (with-server (server 'gallop:easy-acceptor :read-timeout 1 :write-timeout 1)
    (let ((socket (connect (port-of server))))
      (unwind-protect
           (progn
             (send socket (crlf "GET /huge HTTP/1.1" "Host: x"))
             ;; Never read: the worker's write times out instead of blocking forever.
             (is (wait-until (lambda () (and (plusp (stat server :timeouts))
                                             (zerop (stat server :in-flight))))
                             :timeout 20)))
        (usocket:socket-close socket)))
    (is (= 200 (response-status (get-request (port-of server) "/yo"))))))

(test a-body-that-stops-arriving-times-out
  (with-server (server 'gallop:easy-acceptor :read-timeout 1 :write-timeout 1)
    (let ((socket (connect (port-of server))))
      (unwind-protect
           (progn
             (send socket (concatenate 'string
                                       (crlf "POST /body HTTP/1.1" "Host: x"
                                             "Content-Type: application/octet-stream"
                                             "Content-Length: 1000")
                                       "only a little"))
             (is (wait-until (lambda () (and (plusp (stat server :timeouts))
                                             (zerop (stat server :in-flight))))
                             :timeout 20))
             ;; The client is answered or closed, not left hanging.
             (let ((r (handler-case (read-response socket) (error () :error))))
               (is (or (null r) (eq r :error) (<= 400 (response-status r))))))
        (usocket:socket-close socket)))
    (is (= 200 (response-status (get-request (port-of server) "/yo"))))))

(test idle-tls-connections-time-out-too
  (let ((server (make-ssl-server 'gallop:easy-ssl-acceptor
                                 :taskmaster (make-instance 'gallop:taskmaster :idle-timeout 1))))
    (hunchentoot:start server)
    (unwind-protect
         ;; A raw TLS client, closed explicitly: a client stream left to the GC
         ;; would have its fd closed by a finalizer later, when that number
         ;; may belong to another test's socket.
         (let ((socket (connect (port-of server))))
           (unwind-protect
                (let ((tls (cl+ssl:make-ssl-client-stream (usocket:socket-stream socket)
                                                          :verify nil)))
                  (write-sequence (octets (crlf "GET /yo HTTP/1.1" "Host: x")) tls)
                  (force-output tls)
                  (let ((head (loop for line = (read-line-crlf tls)
                                    until (or (null line) (zerop (length line)))
                                    collect line)))
                    (is (search "200" (first head))))
                  (is (= 1 (stat server :open)))
                  ;; The idle TLS connection is closed after the idle timeout.
                  (is (wait-until (lambda () (zerop (stat server :open))) :timeout 10))
                  (ignore-errors (close tls)))
             (usocket:socket-close socket)))
      (hunchentoot:stop server))))

(test a-handler-reads-the-body-as-a-stream
  (with-server (server 'gallop:easy-acceptor)
    (let* ((payload (make-string 30000 :initial-element #\z))
           (response (request (port-of server)
                              (concatenate 'string
                                           (crlf "POST /stream-body HTTP/1.1" "Host: x"
                                                 "Content-Type: application/octet-stream"
                                                 (format nil "Content-Length: ~D" (length payload)))
                                           payload))))
      (is (= 200 (response-status response)))
      (is (string= "30000" (body-string response))))))

(test a-detached-stream-reads-what-the-client-sends-next
  ;; After DETACH-SOCKET the stream is the handler's: it reads the client's
  ;; next bytes (not an end of file at the end of the request), on a Gallop
  ;; acceptor and on a stock one with gallop:taskmaster.
  (dolist (initargs (list '() (list :taskmaster (make-instance 'gallop:taskmaster))))
    (let ((server (apply #'make-server (if initargs 'hunchentoot:easy-acceptor 'gallop:easy-acceptor)
                         initargs)))
      (hunchentoot:start server)
      (unwind-protect
           (let ((socket (connect (port-of server))))
             (unwind-protect
                  (let ((stream (usocket:socket-stream socket)))
                    ;; HTTP/1.0, so that the head announces no chunked body
                    (send socket (crlf "GET /detach-echo HTTP/1.0" "Host: x"))
                    ;; the head Hunchentoot wrote, up to its empty line
                    (loop for line = (read-line-crlf stream)
                          until (or (null line) (zerop (length line))))
                    (send socket (format nil "hello~C" #\Linefeed))
                    (is (equal "echo: hello"
                               (map 'string #'code-char (read-to-eof stream)))))
               (usocket:socket-close socket)))
        (hunchentoot:stop server)))))

(test detach-socket-hands-the-stream-to-the-handler
  (with-server (server 'gallop:easy-acceptor)
    (let ((response (get-request (port-of server) "/detach")))
      (is (= 200 (response-status response)))
      (is (string= "late" (body-string response))))
    (is (wait-until (lambda () (zerop (stat server :open)))))
    (is (= 200 (response-status (get-request (port-of server) "/yo"))))))
