;;;; tls.lisp -- TLS on the engine's event loop (src/core/os/openssl.lisp), on
;;;; both front ends: GALLOP:START with a certificate, and
;;;; GALLOP:EASY-SSL-ACCEPTOR.  Through hunchentoot/tls.lisp's client (cl+ssl
;;;; over a real socket to 127.0.0.1), answers read strictly:
;;;;   - answers are exact over TLS: string, file (sent from a file through
;;;;     OpenSSL) and streamed bodies, keep-alive, :URL-SCHEME "https";
;;;;   - a 2 MiB file, a 1 MiB body and a 4 MiB streamed answer to a client
;;;;     that does not read at first: the answer waits in epoll (:WRITING),
;;;;     OpenSSL's retried writes lose and repeat no octet;
;;;;   - a close_notify that arrives with the last request ends the
;;;;     connection after its answer, not at the idle timeout;
;;;;   - 2,000 idle TLS keep-alive connections hold no thread;
;;;;   - a stalled handshake is closed at the header timeout, without a
;;;;     plaintext 408; a dribbled head after a handshake gets 408 over TLS;
;;;;   - TLS clients that hang up anywhere cost no log line and no fd.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: the memory account and the
;;;; engine's TLS counters and trim threshold (account.lisp, engine.lisp,
;;;; os/openssl.lisp): that closed TLS connections give their memory back.

(in-package #:gallop-tests)

(in-suite ssl)

;;; The native server over TLS

(defparameter *tls-file-size* (* 2 1024 1024))

(defvar *tls-test-file* nil)

(defun tls-test-file ()
  "A file of *TLS-FILE-SIZE* octets, octet I being (mod (* 7 I) 253), made
once per run."
  (or (and *tls-test-file* (probe-file *tls-test-file*) *tls-test-file*)
      (let ((path (merge-pathnames "tls-body.bin" (run-directory))))
        (with-open-file (out path :direction :output :element-type '(unsigned-byte 8)
                                  :if-exists :supersede)
          (write-sequence (expected-tls-file) out))
        (setf *tls-test-file* path))))

(defun expected-tls-file ()
  (let ((octets (make-array *tls-file-size* :element-type '(unsigned-byte 8))))
    (dotimes (i *tls-file-size* octets)
      (setf (aref octets i) (mod (* 7 i) 253)))))

(defun tls-app (env)
  (let ((path (getf env :path-info)))
    (cond ((string= path "/file") (list 200 '(:content-type "application/octet-stream")
                                        (tls-test-file)))
          ((string= path "/big")
           (list 200 '(:content-type "application/octet-stream")
                 (let ((data (make-array *big-size* :element-type '(unsigned-byte 8))))
                   (dotimes (i *big-size* data) (setf (aref data i) (mod i 251))))))
          ((string= path "/stream")
           (lambda (responder)
             (let ((writer (funcall responder '(200 (:content-type "text/plain")))))
               (funcall writer "one,")
               (funcall writer "two," )
               (funcall writer "three" :close t))))
          ((string= path "/scheme")
           (list 200 '(:content-type "text/plain")
                 (list (format nil "~A ~A" (getf env :url-scheme) (getf env :server-protocol)))))
          (t '(200 (:content-type "text/plain") ("Hey!"))))))

(defmacro with-tls-app ((server app &rest options) &body body)
  "WITH-APP over TLS, with the tests' certificate."
  `(with-app (,server ,app :ssl-certificate-file (first (test-certificate))
                           :ssl-privatekey-file (second (test-certificate)) ,@options)
     ,@body))

(defun tls-get (client path &key close)
  "Send GET PATH on CLIENT and read the answer strictly (a WIRE-RESPONSE, or
the WIRE-ERROR)."
  (tls-send client (octets (if close
                               (crlf (format nil "GET ~A HTTP/1.1" path) "Host: x" "Connection: close")
                               (crlf (format nil "GET ~A HTTP/1.1" path) "Host: x"))))
  (tls-read-wire client :close close :timeout 20))

(defun check-exact-tls-answer (what response body &key (framing :content-length))
  "RESPONSE is a 200 whose body is exactly BODY (a string or octets), framed
as FRAMING says (Content-Length equal to the body, or chunked)."
  (is (wire-response-p response) "~A: ~A" what response)
  (when (wire-response-p response)
    (is (= 200 (wire-status response)) "~A: status ~D" what (wire-status response))
    (let ((expected (if (stringp body) (octets body) body)))
      (ecase framing
        (:content-length
         (is (equal (princ-to-string (length expected)) (wire-header response "Content-Length"))
             "~A: Content-Length ~S for ~D octets" what (wire-header response "Content-Length")
             (length expected)))
        (:chunked
         (is (equal "chunked" (wire-header response "Transfer-Encoding")) "~A: not chunked" what)))
      (is (equalp expected (wire-body response))
          "~A: the body differs (~D octets, ~D expected~@[, first difference at ~D~])" what
          (length (wire-body response)) (length expected)
          (mismatch expected (wire-body response))))))

(test native-tls-answers-are-exact
  (with-tls-app (server #'tls-app)
    (let ((client (tls-connect (native-port server))))
      (unwind-protect
           (progn
             ;; Keep-alive: four answers on one TLS connection.
             (check-exact-tls-answer "string" (tls-get client "/") "Hey!")
             (check-exact-tls-answer "scheme" (tls-get client "/scheme") "https HTTP/1.1")
             (check-exact-tls-answer "streamed" (tls-get client "/stream") "one,two,three"
                                     :framing :chunked)
             (check-exact-tls-answer "file" (tls-get client "/file") (expected-tls-file))
             (check-exact-tls-answer "last" (tls-get client "/" :close t) "Hey!"))
        (tls-close client)))
    (is (wait-until (lambda () (zerop (getf (gallop:stats server) :open)))))))

(test native-start-refuses-a-key-that-is-not-the-certificates
  (destructuring-bind (cert key) (test-certificate)
    (declare (ignore key))
    ;; The certificate file has no private key in it.
    (signals error (gallop:start #'tls-app :port 0 :ssl-certificate-file cert
                                           :ssl-privatekey-file cert :log nil))))

;;; Answers the client does not read at once: they wait in epoll, and what
;;; OpenSSL could not write is written again, the same octets.

(defun tls-connect-slow-reader (port)
  "A TLS client whose socket has a 4 KiB receive buffer: what it does not
read fills the server's socket after a few KiB."
  (let ((socket (make-instance 'sb-bsd-sockets:inet-socket :type :stream :protocol :tcp)))
    ;; SOL_SOCKET, SO_RCVBUF: before connect, so the window is small from the start.
    (set-socket-option (sb-bsd-sockets:socket-file-descriptor socket) 1 8 4096)
    (sb-bsd-sockets:socket-connect socket #(127 0 0 1) port)
    (make-tls-client
     :socket socket
     :stream (sb-sys:with-deadline (:seconds 10)
               (cl+ssl:make-ssl-client-stream
                (sb-bsd-sockets:socket-make-stream socket :input t :output t
                                                          :element-type '(unsigned-byte 8))
                :verify nil)))))

(defun check-unread-tls-answer (port stats path expected)
  "Ask PATH on a slow-reading TLS client and read nothing until the answer
waits in epoll (STATS: :WRITING 1), then read it all: exactly EXPECTED.
Twice on one connection."
  (let ((client (tls-connect-slow-reader port)))
    (unwind-protect
         (dotimes (i 2)
           (tls-send client (octets (crlf (format nil "GET ~A HTTP/1.1" path) "Host: x")))
           (is (wait-until (lambda () (eql 1 (getf (funcall stats) :writing))) :timeout 10)
               "~A: the answer does not wait in epoll: ~S" path (funcall stats))
           (check-exact-tls-answer (format nil "~A, unread at first" path)
                                   (tls-read-wire client :timeout 20) expected))
      (tls-close client))))

(test tls-answers-a-client-does-not-read-wait-in-epoll-and-arrive-exact
  (with-tls-app (server #'tls-app)
    (let ((stats (lambda () (gallop:stats server))))
      (check-unread-tls-answer (native-port server) stats "/file" (expected-tls-file))
      (check-unread-tls-answer (native-port server) stats "/big"
                               (let ((data (make-array *big-size* :element-type '(unsigned-byte 8))))
                                 (dotimes (i *big-size* data) (setf (aref data i) (mod i 251)))))))
  (let ((server (make-ssl-server 'gallop:easy-ssl-acceptor)))
    (hunchentoot:start server)
    (unwind-protect
         (check-unread-tls-answer (port-of server) (lambda () (gallop:stats server)) "/big"
                                  (let ((data (make-array *big-size* :element-type '(unsigned-byte 8))))
                                    (dotimes (i *big-size* data) (setf (aref data i) (mod i 251)))))
      (hunchentoot:stop server))))

(test tls-streaming-writer-does-not-wait-for-its-reader
  "A handler streams 4 MiB over TLS, in large and small pieces, to a client
that reads nothing: it finishes first, what it wrote past :MAX-UNSENT-BYTES
waiting in spill buffers; then the client reads it all, exactly (OpenSSL's
retried writes lose and repeat no octet), and the account's :OUTPUT is back
where it was."
  (let* ((pieces (streamed-pieces 50))
         (finished (list '()))
         (before (gallop.core::account-used :output)))
    (with-tls-app (server (piece-streaming-app pieces finished))
      (let ((client (tls-connect-slow-reader (native-port server))))
        (unwind-protect
             (progn
               (tls-send client (octets (crlf "GET /pieces HTTP/1.1" "Host: x")))
               (is-true (wait-until (lambda () (car finished)) :timeout 10)
                        "the handler did not finish before its client read")
               (is (equal '(t) (car finished)))
               (is (wait-until (lambda () (eql 1 (getf (gallop:stats server) :writing))))
                   "the answer does not wait in epoll: ~S" (gallop:stats server))
               (check-exact-tls-answer "streamed, unread at first"
                                       (tls-read-wire client :timeout 20) (joined-octets pieces)
                                       :framing :chunked))
          (tls-close client)))
      (is (wait-until (lambda () (zerop (getf (gallop:stats server) :open))))))
    (is-true (wait-until (lambda () (= before (gallop.core::account-used :output))))
             ":OUTPUT is ~D, was ~D before" (gallop.core::account-used :output) before)))

;;; The client's close_notify

(test a-close-notify-behind-the-last-request-ends-the-connection
  ;; A client that sends its last request and its close_notify together,
  ;; then waits for the answer before it closes: OpenSSL reads both at once,
  ;; and the socket raises no further event.  The server must end the
  ;; connection after the answer (its own close_notify), not at its idle
  ;; timeout (60 s here, past the client's wait).
  (with-tls-app (server #'tls-app :idle-timeout 60)
    (let* ((client (tls-connect (native-port server)))
           (fd (sb-bsd-sockets:socket-file-descriptor (tls-socket client))))
      (unwind-protect
           (progn
             ;; IPPROTO_TCP, TCP_CORK: the request's record and the alert
             ;; leave as one segment when the cork is taken off.
             (set-socket-option fd 6 3 1)
             (tls-send client (octets (crlf "GET / HTTP/1.1" "Host: x")))
             (is (tls-end-output client))
             (set-socket-option fd 6 3 0)
             (check-exact-tls-answer "the last answer" (tls-read-wire client :close t :timeout 10)
                                     "Hey!"))
        (tls-close client)))
    (is (wait-until (lambda () (zerop (getf (gallop:stats server) :open)))))))

;;; The handshake and the head are bounded by the header timeout

(test a-stalled-tls-handshake-is-closed-at-the-header-timeout-without-an-answer
  (with-tls-app (server #'tls-app :header-timeout 1)
    (let ((socket (connect (native-port server))))
      (unwind-protect
           (let ((stream (usocket:socket-stream socket)))
             (write-sequence (tls-client-hello-start) stream)
             (force-output stream)
             ;; No plaintext 408 to a client that speaks TLS: only the end.
             (multiple-value-bind (octets end) (read-all-with-timeout stream 8)
               (is (eq :eof end) "the stalled handshake was not closed: ~S" end)
               (is (zerop (length octets)) "sent ~D octets: ~S" (length octets) octets)))
        (usocket:socket-close socket)))
    (is (wait-until (lambda () (zerop (getf (gallop:stats server) :open)))))
    (is (plusp (getf (gallop:stats server) :timeouts)))))

(test a-dribbled-head-after-the-tls-handshake-gets-408
  (with-tls-app (server #'tls-app :header-timeout 1)
    (let ((client (tls-connect (native-port server))))
      (unwind-protect
           (progn
             (tls-send client (octets (format nil "GET / HTTP/1.1~C~CHost: x~C~C" #\Return #\Linefeed
                                              #\Return #\Linefeed)))
             (let ((response (tls-read-wire client :close t :timeout 8)))
               (is (and (wire-response-p response) (= 408 (wire-status response))) "~A" response)))
        (tls-close client)))))

(test an-http/0.9-request-line-over-tls-gets-400-at-once
  ;; As on a plain connection: refused when the line is whole, not when the
  ;; header timeout (a minute here) runs out.
  (with-tls-app (server #'tls-app :header-timeout 60)
    (let ((client (tls-connect (native-port server))))
      (unwind-protect
           (progn
             (tls-send client (octets (format nil "GET /fast~C~C" #\Return #\Linefeed)))
             (let ((response (tls-read-wire client :close t :timeout 8)))
               (is (and (wire-response-p response) (= 400 (wire-status response))) "~A" response)))
        (tls-close client)))))

(defun read-all-with-timeout (stream seconds)
  "Read STREAM to its end within SECONDS: the octets, and :EOF or :TIMEOUT
\(or :RESET when the read failed)."
  (let ((out (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0)))
    (values out
            (handler-case
                (sb-sys:with-deadline (:seconds seconds)
                  (loop for b = (read-byte stream nil nil)
                        while b do (vector-push-extend b out))
                  :eof)
              (sb-sys:deadline-timeout () :timeout)
              (error () :reset)))))

;;; TLS clients that hang up

(defun tls-abort (client how)
  "Give up on CLIENT: HOW is :CLOSE (FIN, no close_notify) or :RESET (RST)."
  (let ((socket (tls-socket client)))
    (when (eq how :reset)
      (set-reset-on-close (sb-bsd-sockets:socket-file-descriptor socket)))
    (ignore-errors (sb-bsd-sockets:socket-close socket))
    (ignore-errors (close (tls-stream client) :abort t))))

(defun check-tls-aborts (port stats log-text)
  "TLS clients giving up in the handshake, in a head, in a body and in a
1 MiB answer, each with FIN and with RST: every connection is closed, no
fd is left, nothing is logged, and the server serves on."
  (let ((fds (fd-count)))
    (dolist (how '(:close :reset :close :reset))
      ;; half a ClientHello
      (let ((socket (connect port)))
        (write-sequence (tls-client-hello-start) (usocket:socket-stream socket))
        (force-output (usocket:socket-stream socket))
        (sleep 0.02)
        (abort-connection socket how))
      ;; half a head, part of a body, part of an answer
      (dolist (text (list (format nil "GET /yo HTTP/1.1~C~CHo" #\Return #\Linefeed)
                          (concatenate 'string (crlf "POST /body HTTP/1.1" "Host: x"
                                                     "Content-Length: 100000")
                                       (make-string 1000 :initial-element #\a))
                          :big))
        (let ((client (tls-connect port)))
          (if (eq text :big)
              (progn (tls-send client (octets (crlf "GET /big HTTP/1.1" "Host: x")))
                     (let ((buffer (make-array 4000 :element-type '(unsigned-byte 8))))
                       (read-sequence buffer (tls-stream client))))
              (tls-send client (octets text)))
          (sleep 0.02)
          (tls-abort client how))))
    (let ((client (tls-connect port)))
      (unwind-protect (check-exact-tls-answer "after the aborts" (tls-get client "/yo" :close t)
                                              "Hey!")
        (tls-close client)))
    (is (wait-until (lambda () (let ((s (funcall stats)))
                                 (and (zerop (getf s :open)) (zerop (getf s :in-flight)))))
                    :timeout 15)
        "connections left: ~S" (funcall stats))
    (is (wait-until (lambda () (<= (fd-count) fds)) :timeout 5)
        "fds: ~D before, ~D after" fds (fd-count))
    (let ((text (funcall log-text)))
      (is (zerop (length text)) "logged:~%~A" (subseq text 0 (min 3000 (length text)))))))

(defun tls-abort-app (env)
  "TLS-APP, with /yo and /body as the easy handlers answer them."
  (let ((path (getf env :path-info)))
    (cond ((string= path "/body")
           (let ((body (read-all-octets (getf env :raw-body))))
             (list 200 '(:content-type "text/plain")
                   (list (format nil "~D" (length body))))))
          ((string= path "/yo") '(200 (:content-type "text/plain") ("Hey!")))
          (t (tls-app env)))))

(test tls-clients-that-hang-up-cost-no-log-line-and-leak-nothing
  (let ((log (make-string-output-stream)))
    (with-tls-app (server #'tls-abort-app :log log)
      (check-tls-aborts (native-port server) (lambda () (gallop:stats server))
                        (lambda () (get-output-stream-string log)))))
  (let* ((log (make-string-output-stream))
         (server (make-ssl-server 'gallop:easy-ssl-acceptor :message-log-destination log)))
    (hunchentoot:start server)
    (unwind-protect
         (check-tls-aborts (port-of server) (lambda () (gallop:stats server))
                           (lambda () (get-output-stream-string log)))
      (hunchentoot:stop server))))

;;; An acceptor that does TLS itself, in INITIALIZE-CONNECTION-STREAM, and is
;;; not a HUNCHENTOOT:SSL-ACCEPTOR: Gallop cannot know its TLS, so its engine
;;; is raw and the requests are read through that stream
;;; (src/core/http/tls.lisp), with the same checks.

(defclass stream-tls-acceptor (gallop:easy-acceptor)
  ((certificate :initarg :certificate :reader stream-tls-certificate)
   (key :initarg :key :reader stream-tls-key))
  (:documentation "An easy acceptor wrapping each connection in cl+ssl itself."))

(defmethod hunchentoot:acceptor-ssl-p ((acceptor stream-tls-acceptor))
  t)

(defmethod hunchentoot:initialize-connection-stream ((acceptor stream-tls-acceptor) stream)
  (call-next-method acceptor
                    (cl+ssl:make-ssl-server-stream
                     stream :certificate (namestring (stream-tls-certificate acceptor))
                            :key (namestring (stream-tls-key acceptor)))))

(test an-acceptor-doing-its-own-tls-is-served-through-its-stream
  (destructuring-bind (cert key) (test-certificate)
    (let ((server (make-server 'stream-tls-acceptor :certificate cert :key key)))
      (hunchentoot:start server)
      (unwind-protect
           (let ((client (tls-connect (port-of server))))
             (unwind-protect
                  (progn
                    (check-exact-tls-answer "own TLS, first" (tls-get client "/yo") "Hey!")
                    (check-exact-tls-answer "own TLS, second" (tls-get client "/yo?name=x") "Hey x!")
                    ;; A head over the limit is refused through that stream too.
                    (tls-send client (octets (crlf (format nil "GET /~A HTTP/1.1"
                                                           (make-string 70000 :initial-element #\a))
                                                   "Host: x")))
                    (let ((response (tls-read-wire client :close t :timeout 10)))
                      (is (and (wire-response-p response) (= 414 (wire-status response)))
                          "~A" response)))
               (tls-close client)))
        (hunchentoot:stop server)))))

;;; Closed TLS connections give their memory back: once enough SSL objects
;;; were freed, the housekeeper trims malloc's heap (housekeeper.lisp,
;;; TRIM-MALLOC).  The RSS it gives back is measured by make bench-tls-hold;
;;; here, that the trim comes.

(test closed-tls-connections-make-the-housekeeper-trim-malloc
  (with-tls-app (server #'tls-app)
    (let* ((engine (gallop::server-engine server))
           (n (+ 8 gallop.core::+trim-after-tls-frees+))
           (clients (loop repeat n collect (tls-connect (native-port server)))))
      (is (every #'identity clients))
      (is (zerop (gallop.core::engine-tls-trimmed engine)))
      (mapc #'tls-close clients)
      (is (wait-until (lambda () (zerop (stat server :open))) :timeout 20)
          "still open: ~S" (gallop:stats server))
      (is (>= (gallop.core::engine-tls-freed engine) n))
      ;; The housekeeper trims at its next tick (once a second at rest).
      (is (wait-until (lambda () (>= (gallop.core::engine-tls-trimmed engine)
                                     gallop.core::+trim-after-tls-frees+))
                      :timeout 10)
          "no trim after ~D SSL objects freed" (gallop.core::engine-tls-freed engine)))))
