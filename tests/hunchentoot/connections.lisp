;;;; connections.lisp -- idle and slow clients hold no thread: many idle
;;;; keep-alive connections, slowloris, and timeouts that need no thread per
;;;; connection.

(in-package #:gallop-tests)

(def-suite connections :in gallop :description "Event-driven connections.")
(in-suite connections)

(defun raise-test-fd-limit ()
  (gallop.core:raise-fd-limit))

(test two-thousand-idle-keep-alive-connections-hold-no-thread
  (raise-test-fd-limit)
  (with-server (server 'gallop:easy-acceptor
                       :taskmaster (make-instance 'gallop:taskmaster :standby-thread-count 4))
    (let ((sockets '()))
      (unwind-protect
           (progn
             (dotimes (i 2000)
               (let ((socket (connect (port-of server))))
                 (push socket sockets)
                 (send socket (crlf "GET /yo HTTP/1.1" "Host: x"))))
             (is (= 2000 (count-if (lambda (s)
                                     (let ((r (read-response s)))
                                       (and r (= 200 (response-status r)))))
                                   sockets)))
             (is (wait-until (lambda () (= 2000 (stat server :idle)))))
             ;; 2,000 open connections, and the pool is still its standby size.
             (is (<= (stat server :threads) 12) "threads: ~D" (stat server :threads))
             ;; A new client is served at once, and so are the idle ones.
             (is (= 200 (response-status (get-request (port-of server) "/yo"))))
             (let ((some (subseq sockets 0 50)))
               (dolist (s some) (send s (crlf "GET /yo?name=again HTTP/1.1" "Host: x")))
               (is (every (lambda (s) (string= "Hey again!" (body-string (read-response s))))
                          some))))
        (mapc #'usocket:socket-close sockets)))
    (is (wait-until (lambda () (zerop (stat server :open)))))))

(defun slowloris (port count seconds &key (interval 1))
  "Open COUNT connections that send a request head one header line every
INTERVAL seconds for SECONDS, never finishing it.  Returns the sockets."
  (let ((sockets (loop repeat count
                       collect (let ((s (connect port)))
                                 (send s (format nil "GET /yo HTTP/1.1~C~C" #\Return #\Linefeed))
                                 s))))
    (loop repeat (floor seconds interval)
          do (sleep interval)
             (dolist (s sockets)
               (ignore-errors (send s (format nil "X-a: b~C~C" #\Return #\Linefeed)))))
    sockets))

(test slowloris-neither-blocks-requests-nor-grows-the-pool
  (raise-test-fd-limit)
  (with-server (server 'gallop:easy-acceptor
                       :taskmaster (make-instance 'gallop:taskmaster :standby-thread-count 4
                                                                     :header-timeout 30))
    (let* ((sockets nil)
           (attacker (sb-thread:make-thread
                      (lambda () (setf sockets (slowloris (port-of server) 1000 4)))))
           (statuses '())
           (worst 0)
           (peak-threads 0))
      (unwind-protect
           (progn
             (loop while (sb-thread:thread-alive-p attacker)
                   do (let* ((start (get-internal-real-time))
                             (r (get-request (port-of server) "/yo")))
                        (push (response-status r) statuses)
                        (setf worst (max worst (- (get-internal-real-time) start))
                              peak-threads (max peak-threads (stat server :threads))))
                      (sleep 0.05))
             (sb-thread:join-thread attacker)
             (is (plusp (length statuses)))
             (is (every (lambda (s) (= 200 s)) statuses))
             ;; 1,000 slow clients are parked, not served: no thread each.
             (is (<= 1000 (stat server :idle)))
             (is (<= peak-threads 12) "peak threads: ~D" peak-threads)
             (format t "~&    slowloris: ~D requests, slowest ~,1F ms, peak threads ~D~%"
                     (length statuses)
                     (/ worst (/ internal-time-units-per-second 1000)) peak-threads))
        (mapc #'usocket:socket-close sockets)))))

(test slowhttptest-slowloris-leaves-the-service-available
  (raise-test-fd-limit)
  (with-server (server 'gallop:easy-acceptor
                       :taskmaster (make-instance 'gallop:taskmaster :standby-thread-count 4))
    (let* ((output nil)
           (attacker (sb-thread:make-thread
                      (lambda ()
                        (setf output
                              (uiop:run-program
                               (list "slowhttptest" "-H" "-c" "1000" "-r" "500" "-i" "1"
                                     "-l" "6" "-p" "2" "-x" "8"
                                     "-u" (url server "/yo"))
                               :output :string :error-output :output :ignore-error-status t)))))
           (statuses '())
           (peak-threads 0))
      (loop while (sb-thread:thread-alive-p attacker)
            do (push (response-status (get-request (port-of server) "/yo")) statuses)
               (setf peak-threads (max peak-threads (stat server :threads)))
               (sleep 0.1))
      (sb-thread:join-thread attacker)
      (is (every (lambda (s) (= 200 s)) statuses))
      (is (<= peak-threads 12) "peak threads: ~D" peak-threads)
      (is (search "service available" output) "slowhttptest ran: ~A" output)
      (is (not (search "service available:   NO" output)) "~A" output))))

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
