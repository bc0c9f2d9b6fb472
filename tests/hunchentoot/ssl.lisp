;;;; ssl.lisp -- the TLS acceptors over a real handshake, with a certificate
;;;; made by openssl when the tests run.

(in-package #:gallop-tests)

(def-suite ssl :in gallop :description "GALLOP:SSL-ACCEPTOR and GALLOP:EASY-SSL-ACCEPTOR.")
(in-suite ssl)

(defvar *certificate* nil)

(defun test-certificate ()
  "A self-signed certificate and key, as two pathnames, made once per run."
  (or *certificate*
      (let* ((dir (uiop:ensure-directory-pathname
                   (format nil "/tmp/gallop-tests-~D" (sb-posix:getpid))))
             (cert (merge-pathnames "cert.pem" dir))
             (key (merge-pathnames "key.pem" dir)))
        (ensure-directories-exist dir)
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

(test ssl-acceptor-answers-over-tls
  (let ((server (make-ssl-server 'gallop:ssl-acceptor)))
    (hunchentoot:start server)
    (unwind-protect
         (multiple-value-bind (body status) (https server "/anything")
           (declare (ignore body))
           ;; A plain acceptor dispatches nothing: Hunchentoot's 404.
           (is (= 404 status)))
      (hunchentoot:stop server))))

(test a-failed-handshake-leaves-the-server-serving
  (let ((server (make-ssl-server 'gallop:easy-ssl-acceptor)))
    (hunchentoot:start server)
    (unwind-protect
         (progn
           ;; Plain HTTP to a TLS port: the handshake fails, the server lives on.
           (let ((socket (connect (port-of server))))
             (send socket (crlf "GET /yo HTTP/1.1" "Host: x"))
             (handler-case (read-to-eof (usocket:socket-stream socket))
               (error () nil))
             (usocket:socket-close socket))
           (multiple-value-bind (body status) (https server "/yo")
             (is (= 200 status))
             (is (string= "Hey!" body))))
      (hunchentoot:stop server))))
