;;;; connections.lisp -- slow clients and timeouts on the drop-in acceptor:
;;;; a client that stops reading, a body that stops arriving, idle TLS
;;;; connections timing out, streams handed to the handler.  (Thousands of
;;;; idle and slowloris connections: tests/stress/connections.lisp.)

(in-package #:gallop-tests)

(def-suite connections :in gallop :description "Event-driven connections.")
(in-suite connections)

(defun raise-test-fd-limit ()
  (raise-fd-limit))

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

(test a-detached-stream-closed-before-its-handler-returns-closes
  ;; The handler's thread may read, answer and close the detached stream
  ;; before the worker is done with the connection (the handler returns
  ;; last here, every time); the handler may also close it itself.  Either
  ;; close ends the connection: the client reads the echo, then the end.
  ;; The line comes with the request, so the echo needs no further write.
  (dolist (initargs (list '() (list :taskmaster (make-instance 'gallop:taskmaster))))
    (let ((server (apply #'make-server (if initargs 'hunchentoot:easy-acceptor 'gallop:easy-acceptor)
                         initargs)))
      (hunchentoot:start server)
      (unwind-protect
           (dolist (path '("/detach-echo-first" "/detach-echo-here"))
             (let ((socket (connect (port-of server) :timeout 5)))
               (unwind-protect
                    (let ((stream (usocket:socket-stream socket)))
                      (send socket (format nil "~A~A~C"
                                           (crlf (format nil "GET ~A HTTP/1.0" path) "Host: x")
                                           "hello" #\Linefeed))
                      (let ((head (loop for line = (read-line-crlf stream)
                                        collect line
                                        until (or (null line) (zerop (length line)))))
                            (rest (handler-case (map 'string #'code-char (read-to-eof stream))
                                    (sb-sys:io-timeout () :no-end-of-file))))
                        (is (equal "HTTP/1.1 200 OK" (first head)) "~A: ~S" path head)
                        (is (equal "echo: hello" rest) "~A: ~S" path rest)))
                 (usocket:socket-close socket))))
        (is (wait-until (lambda () (zerop (stat server :open)))) "a connection left open")
        (hunchentoot:stop server)))))

;;; What a client of /detach-flood must read: the head once, then the thread's
;;; octets, exactly.

(defun detach-flood-problem (all)
  "NIL when ALL (the octets read up to the end of file) is one head of
status 200 followed by exactly *DETACH-FLOOD*; else what is wrong."
  (let* ((text (map 'string #'code-char all))
         (end (search (format nil "~C~C~C~C" #\Return #\Linefeed #\Return #\Linefeed) text))
         (heads (loop for i = (search "HTTP/1.1 " text) then (search "HTTP/1.1 " text :start2 (1+ i))
                      while i count t)))
    (cond ((null end) (format nil "no head in ~D octets: ~S" (length all) (subseq text 0 (min 24 (length text)))))
          ((not (eql 0 (search (format nil "HTTP/1.1 200 OK~C~C" #\Return #\Linefeed) text)))
           (format nil "the head begins ~S" (subseq text 0 (min 40 (length text)))))
          ((/= heads 1) (format nil "~D heads in ~D octets" heads (length all)))
          ((not (equalp (subseq all (+ end 4)) *detach-flood*))
           (let* ((body (subseq all (+ end 4)))
                  (at (mismatch body *detach-flood*)))
             (format nil "~D octets after the head, ~D expected; they differ from octet ~D: ~{~D~^ ~}"
                     (length body) (length *detach-flood*) at
                     (coerce (subseq body at (min (length body) (+ at 12))) 'list)))))))

(test a-detached-stream-carries-the-head-once-then-its-owner-s-octets
  ;; The handler's head is only buffered when it detaches; the thread it
  ;; gives the stream to writes at once, while the worker finishes the
  ;; request: the head goes once, first, and nothing the worker does after
  ;; the handler touches the stream.  20 connections on each acceptor.
  (dolist (initargs (list '() (list :taskmaster (make-instance 'gallop:taskmaster))))
    (let ((server (apply #'make-server (if initargs 'hunchentoot:easy-acceptor 'gallop:easy-acceptor)
                         initargs))
          (problems '()))
      (hunchentoot:start server)
      (unwind-protect
           (progn
             (dotimes (i 20)
               (let ((socket (connect (port-of server) :timeout 5)))
                 (unwind-protect
                      (progn
                        (send socket (crlf "GET /detach-flood HTTP/1.0" "Host: x"))
                        (let ((problem (handler-case (detach-flood-problem
                                                      (read-to-eof (usocket:socket-stream socket)))
                                         (sb-sys:io-timeout () "no end of file"))))
                          (when problem (push problem problems))))
                   (usocket:socket-close socket))))
             (is (null problems) "~:[Gallop's acceptor~;a stock acceptor~]: ~D of 20 connections wrong; ~
                                  the first: ~A" initargs (length problems) (car (last problems)))
             (is (wait-until (lambda () (zerop (stat server :open)))) "a connection left open"))
        (hunchentoot:stop server)))))

(defun echo-through (port request timing)
  "Send REQUEST to PORT, whose handler answers, then echoes a line on the
same connection (a stream it detached or switched protocols on); the
line goes TIMING: :WITH-REQUEST (in the same write), :WHILE-HANDLER-WAITS
\(in the socket before the handler detaches or switches, see WAIT-FOR-
CLIENT-OCTETS) or :AFTER-HEAD (once the answer's head was read).  The
answer's status line, and what came after its head up to the end of file
\(:NO-END-OF-FILE if none came)."
  (let ((socket (connect port :timeout 5))
        (line (format nil "hello~C" #\Linefeed)))
    (unwind-protect
         (let ((stream (usocket:socket-stream socket)))
           (ecase timing
             (:with-request (send socket (concatenate 'string request line)))
             (:while-handler-waits (send socket request) (send-while-handler-waits socket line))
             (:after-head (send socket request)))
           (let ((head (loop for l = (read-line-crlf stream)
                             collect l
                             until (or (null l) (zerop (length l))))))
             (when (eq timing :after-head)
               (send socket line))
             (values (first head)
                     (handler-case (map 'string #'code-char (read-to-eof stream))
                       (sb-sys:io-timeout () :no-end-of-file)))))
      (usocket:socket-close socket))))

(test the-next-octets-reach-a-detached-or-switched-stream
  ;; What the client sends after its request reaches the handler's stream
  ;; whenever it came: read by the engine with the head, in the socket
  ;; before the handler detached (DETACH-SOCKET) or switched protocols
  ;; (a 101), or after the answer's head (a WebSocket's first frame).
  (dolist (initargs (list '() (list :taskmaster (make-instance 'gallop:taskmaster))))
    (let ((server (apply #'make-server (if initargs 'hunchentoot:easy-acceptor 'gallop:easy-acceptor)
                         :output-chunking-p nil initargs)))
      (hunchentoot:start server)
      (unwind-protect
           (loop for (request status)
                   in (list (list (crlf "GET /detach-echo HTTP/1.0" "Host: x") "HTTP/1.1 200 OK")
                            (list (crlf "GET /switch-echo HTTP/1.1" "Host: x"
                                        "Upgrade: echo" "Connection: Upgrade")
                                  "HTTP/1.1 101 Switching Protocols"))
                 do (dolist (timing '(:with-request :while-handler-waits :after-head))
                      (with-globals ((*handler-waiting* (and (eq timing :while-handler-waits)
                                                             (sb-thread:make-semaphore)))
                                     (*client-octets-sent* (and (eq timing :while-handler-waits)
                                                                (sb-thread:make-semaphore))))
                        (multiple-value-bind (status-line rest)
                            (echo-through (port-of server) request timing)
                          (is (equal status status-line) "~A, ~A: ~S" request timing status-line)
                          (is (equal "echo: hello" rest) "~A, ~A: ~S" request timing rest)))))
        (is (wait-until (lambda () (zerop (stat server :open)))) "a connection left open")
        (hunchentoot:stop server)))))

(test detach-socket-hands-the-stream-to-the-handler
  (with-server (server 'gallop:easy-acceptor)
    (let ((response (get-request (port-of server) "/detach")))
      (is (= 200 (response-status response)))
      (is (string= "late" (body-string response))))
    (is (wait-until (lambda () (zerop (stat server :open)))))
    (is (= 200 (response-status (get-request (port-of server) "/yo"))))))
