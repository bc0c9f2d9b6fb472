;;;; ssl.lisp -- the TLS acceptors over a real handshake, with a certificate
;;;; made by openssl when the tests run.

(in-package #:gallop-tests)

(def-suite ssl :in gallop :description "GALLOP:SSL-ACCEPTOR and GALLOP:EASY-SSL-ACCEPTOR.")
(in-suite ssl)

(defvar *certificate* nil)

(defun test-certificate ()
  "A self-signed certificate and key, as two pathnames in RUN-DIRECTORY,
made once per run."
  (or (and *certificate* (every #'probe-file *certificate*) *certificate*)
      (let* ((dir (run-directory))
             (cert (merge-pathnames "cert.pem" dir))
             (key (merge-pathnames "key.pem" dir)))
        (uiop:run-program (list "openssl" "req" "-x509" "-newkey" "rsa:2048" "-nodes"
                                "-keyout" (namestring key) "-out" (namestring cert)
                                "-days" "2" "-subj" "/CN=127.0.0.1")
                          :error-output nil :output nil)
        (setf *certificate* (list cert key)))))

(defun make-ssl-server (class &rest initargs)
  (destructuring-bind (cert key) (test-certificate)
    (apply #'make-server class :ssl-certificate-file cert :ssl-privatekey-file key
           initargs)))

(defun https (server path &rest args)
  (apply #'drakma:http-request (format nil "https://127.0.0.1:~D~A" (port-of server) path)
         :verify nil args))

(test easy-ssl-acceptor-serves-over-tls
  (let ((server (make-ssl-server 'gallop:easy-ssl-acceptor)))
    (hunchentoot:start server)
    (unwind-protect
         (progn
           (multiple-value-bind (body status) (https server "/yo?name=tls")
             (is (= 200 status))
             (is (string= "Hey tls!" body)))
           (multiple-value-bind (body status)
               (https server "/params" :method :post :parameters '(("a" . "1") ("b" . "2")))
             (is (= 200 status))
             (is (string= "post a=1 b=2" body)))
           (multiple-value-bind (body status) (https server "/big" :force-binary t)
             (is (= 200 status))
             (is (= *big-size* (length body)))))
      (hunchentoot:stop server))))

(test a-detached-or-switched-stream-speaks-tls
  ;; After DETACH-SOCKET, or a 101, the handler's reads and writes on the
  ;; engine's TLS stay TLS: the client reads the echo of the line it sent
  ;; with its request, then the end of the TLS stream.
  (dolist (initargs (list '() (list :taskmaster (make-instance 'gallop:taskmaster))))
    (let ((server (apply #'make-ssl-server (if initargs 'hunchentoot:easy-ssl-acceptor
                                               'gallop:easy-ssl-acceptor)
                         :output-chunking-p nil initargs)))
      (hunchentoot:start server)
      (unwind-protect
           (loop for (request status)
                   in (list (list (crlf "GET /detach-echo-first HTTP/1.0" "Host: x")
                                  "HTTP/1.1 200 OK")
                            (list (crlf "GET /switch-echo HTTP/1.1" "Host: x"
                                        "Upgrade: echo" "Connection: Upgrade")
                                  "HTTP/1.1 101 Switching Protocols"))
                 do (let ((socket (connect (port-of server) :timeout 5)))
                      (unwind-protect
                           (let ((tls (cl+ssl:make-ssl-client-stream (usocket:socket-stream socket)
                                                                     :verify nil)))
                             (write-sequence (octets (format nil "~Ahello~C" request #\Linefeed)) tls)
                             (force-output tls)
                             (let ((head (handler-case
                                             (loop for line = (read-line-crlf tls)
                                                   collect line
                                                   until (or (null line) (zerop (length line))))
                                           (error (e) (list (princ-to-string e)))))
                                   (rest (handler-case (map 'string #'code-char (read-to-eof tls))
                                           (error (e) (princ-to-string e)))))
                               (is (equal status (first head)) "~A: ~S" request (first head))
                               (is (equal "echo: hello" rest) "~A: ~S" request rest))
                             (ignore-errors (close tls)))
                        (usocket:socket-close socket))))
        (is (wait-until (lambda () (zerop (stat server :open)))) "a connection left open")
        (hunchentoot:stop server)))))

(test ssl-acceptor-answers-over-tls
  (let ((server (make-ssl-server 'gallop:ssl-acceptor)))
    (hunchentoot:start server)
    (unwind-protect
         (multiple-value-bind (body status) (https server "/anything")
           (declare (ignore body))
           ;; A plain acceptor dispatches nothing: Hunchentoot's 404.
           (is (= 404 status)))
      (hunchentoot:stop server))))

(defun tls-client-hello-start ()
  "The first bytes of a TLS ClientHello record: a handshake that starts and
never finishes."
  (coerce #(22 3 1 0 200 1 0 0 196 3 3) '(vector (unsigned-byte 8))))

(test failed-handshakes-leave-the-server-serving-and-leak-nothing
  (let ((server (make-ssl-server 'gallop:easy-ssl-acceptor))
        (silent '()))
    (hunchentoot:start server)
    (unwind-protect
         (progn
           ;; Warm up: one real handshake creates what cl+ssl keeps for good.
           (is (= 200 (nth-value 1 (https server "/yo"))))
           (let ((fds (fd-count))
                 (threads (sb-thread:list-all-threads)))
             (dotimes (i 5)
               ;; Plain HTTP to a TLS port: the handshake fails at once.
               (let ((socket (connect (port-of server))))
                 (send socket (crlf "GET /yo HTTP/1.1" "Host: x"))
                 (handler-case (read-to-eof (usocket:socket-stream socket))
                   (error () nil))
                 (usocket:socket-close socket))
               ;; Half a ClientHello, then FIN; and then RST.
               (dolist (how '(:close :reset))
                 (let ((socket (connect (port-of server))))
                   (write-sequence (tls-client-hello-start) (usocket:socket-stream socket))
                   (force-output (usocket:socket-stream socket))
                   (sleep 0.02)
                   (abort-connection socket how)))
               ;; Connect and send nothing (held in epoll, no thread), then
               ;; go away below.
               (push (connect (port-of server)) silent))
             (multiple-value-bind (body status) (https server "/yo")
               (is (= 200 status))
               (is (string= "Hey!" body)))
             (is (wait-until (lambda () (zerop (stat server :in-flight))) :timeout 15)
                 "~S" (gallop:stats server))
             (mapc #'usocket:socket-close silent)
             (setf silent '())
             (is (wait-until (lambda () (zerop (stat server :open))) :timeout 15)
                 "connections left open: ~S" (gallop:stats server))
             (is (wait-until (lambda () (<= (fd-count) fds)) :timeout 5)
                 "fds: ~D before, ~D after" fds (fd-count))
             (is (no-threads-left-p threads :timeout 15)
                 "threads left: ~S" (threads-started-since threads))))
      (mapc #'usocket:socket-close silent)
      (hunchentoot:stop server))))
