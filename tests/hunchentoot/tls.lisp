;;;; tls.lisp -- the engine's request checks and limits over TLS (issue 13:
;;;; "the same checks and limits on every transport").
;;;;
;;;; A raw TLS client: cl+ssl over a real socket to 127.0.0.1, writing
;;;; exactly the octets a test gives it, each write one TLS record (write,
;;;; then force-output: one SSL_write), and reading exactly what the server
;;;; sends, with the strict reader of tests/strict-reader.lisp.  With it:
;;;;   - the segmentation limits of core/answers.lisp (414, 431, 413 and
;;;;     requests just under each, sent whole, every 1 KiB and one byte at a
;;;;     time) on GALLOP:EASY-SSL-ACCEPTOR;
;;;;   - keep-alive and pipelining over TLS: two requests in one TLS record
;;;;     (the second is left in OpenSSL's buffer, where no socket event says
;;;;     it is there), then an idle connection, then a third request.
;;;; The conformance runner (conformance/runner.lisp) uses the same client
;;;; for its TLS front end.
;;;;
;;;; How a TLS client says "no more": it cannot half-close the way a plain
;;;; client does (shutdown SHUT_WR), since the TLS stream would end without
;;;; its close_notify.  TLS-END-OUTPUT sends close_notify (SSL_shutdown,
;;;; once): it closes only the sender's direction (the client may go on
;;;; reading), and the server's TLS stream reads it as end of file.  The TCP
;;;; connection stays open both ways, and the client reads until the
;;;; server's own close_notify, which a server must send before it closes
;;;; (RFC 9112 9.8; an end without it counts as a failure here, since
;;;; OpenSSL 3 reports it as one).  Every wait is bounded by
;;;; an SBCL deadline (the socket is non-blocking under cl+ssl, which waits
;;;; with WAIT-UNTIL-FD-USABLE and so honours SB-SYS:WITH-DEADLINE).

(in-package #:gallop-tests)

(in-suite ssl)

;;; The client

(defstruct (tls-client (:conc-name tls-))
  "A TLS connection to a test server: SOCKET (sb-bsd-sockets) and STREAM,
the cl+ssl client stream over it."
  socket stream)

(defun tls-connect (port)
  "Connect to 127.0.0.1:PORT and complete a TLS handshake (the server's
certificate is not verified); a TLS-CLIENT.  Each FORCE-OUTPUT on its stream
is one SSL_write, one TLS record of at most 16 KiB."
  (let ((socket (make-instance 'sb-bsd-sockets:inet-socket :type :stream :protocol :tcp))
        (done nil))
    (unwind-protect
         (progn
           (sb-bsd-sockets:socket-connect socket #(127 0 0 1) port)
           ;; Each record goes out at once, not held back by Nagle.
           (setf (sb-bsd-sockets:sockopt-tcp-nodelay socket) t)
           (prog1 (make-tls-client
                   :socket socket
                   :stream (sb-sys:with-deadline (:seconds 10)
                             ;; cl+ssl takes the fd stream's descriptor and
                             ;; gives it to OpenSSL (non-blocking).
                             (cl+ssl:make-ssl-client-stream
                              (sb-bsd-sockets:socket-make-stream
                               socket :input t :output t :element-type '(unsigned-byte 8))
                              :verify nil
                              ;; a piece of up to 16 KiB is one record
                              :buffer-size 16384)))
             (setf done t)))
      (unless done (sb-bsd-sockets:socket-close socket)))))

(defun tls-close (client)
  "Free CLIENT's TLS state and close its socket (no wait)."
  (ignore-errors (close (tls-stream client) :abort t))
  (ignore-errors (sb-bsd-sockets:socket-close (tls-socket client))))

(defun tls-send (client octets &key piece pause)
  "Write OCTETS through CLIENT in pieces of PIECE octets (NIL: at once), each
a TLS record of its own, with PAUSE seconds between them.  True if all was
written; NIL if the server stopped reading first (it may answer and close
before all was sent: a refused head)."
  (let* ((stream (tls-stream client))
         (octets (coerce octets '(simple-array (unsigned-byte 8) (*))))
         (piece (or piece (max 1 (length octets)))))
    (handler-case
        (sb-sys:with-deadline (:seconds 20)
          (loop for start from 0 below (length octets) by piece
                do (write-sequence octets stream :start start
                                                 :end (min (length octets) (+ start piece)))
                   (force-output stream)
                   (when (and pause (< (+ start piece) (length octets)))
                     (sleep pause)))
          t)
      ;; A write refused by the server's end (EPIPE, ECONNRESET: cl+ssl's
      ;; SSL-ERROR), or a server that stopped reading without closing.
      (error () nil))))

(defun tls-end-output (client)
  "Tell the server CLIENT sends nothing more: a close_notify alert
\(SSL_shutdown, whose first call sends it and returns 0).  The client can
still read; see the top of this file."
  (let ((handle (cl+ssl::ssl-stream-handle (tls-stream client))))
    (>= (cl+ssl::ssl-shutdown handle) 0)))

(defun tls-read-to-end (client &key (timeout 6))
  "Read CLIENT until the server ends the connection.  Returns the octets
read, and how it ended: NIL (the server's close_notify), :RESET (the TLS
stream failed: a reset, or the end of the TCP stream without close_notify,
which OpenSSL 3 reports as an error) or :TIMEOUT (TIMEOUT seconds went by
first)."
  (let ((out (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0))
        (stream (tls-stream client)))
    (values out
            (handler-case
                (sb-sys:with-deadline (:seconds timeout)
                  ;; A byte at a time (an SSL_read each): an error after
                  ;; some bytes loses none of them, as a READ-SEQUENCE that
                  ;; fails part way would.  The answers here are small.
                  (loop for b = (read-byte stream nil nil)
                        while b
                        do (vector-push-extend b out))
                  nil)
              (sb-sys:deadline-timeout () :timeout)
              (error () :reset)))))

(defun tls-exchange-octets (port octets &key (timeout 6))
  "The TLS twin of EXCHANGE-OCTETS (conformance/runner.lisp): connect to
127.0.0.1:PORT over TLS, write OCTETS (a record of at most 16 KiB at a
time), send close_notify, and read until the server closes.  Returns the
octets read and how the connection ended, as TLS-READ-TO-END.

There is one thread: cl+ssl's stream must not be read and written at once.
The answers are small, so the server never waits for this client to read
while this client writes; if the server answers and closes before all was
written (a refused head), the write fails and the answer is read, already
received, from the socket.  close_notify is sent only after a complete
write (after a failed one OpenSSL forbids SSL_shutdown)."
  (let ((client (tls-connect port)))
    (unwind-protect
         (progn
           (when (tls-send client octets)
             (tls-end-output client))
           (tls-read-to-end client :timeout timeout))
      (tls-close client))))

(defun tls-wire-source (client)
  "A wire source (tests/strict-reader.lisp) reading CLIENT's TLS stream a byte at a
time; it fails with a WIRE-ERROR on an error of the TLS stream and when
SB-SYS:*DEADLINE* passes."
  (stream-source (tls-stream client) :timeout 'sb-sys:deadline-timeout :failure 'error))

(defun tls-read-wire (client &key close (timeout 5))
  "Read one response from CLIENT strictly (READ-WIRE over TLS), within
TIMEOUT seconds.  With CLOSE, the connection must then end with no further
byte, by the server's close_notify (OpenSSL 3 reports an end of the TCP
stream without it as an error).  A
WIRE-ERROR is returned instead of signalled (for IS)."
  (handler-case
      (sb-sys:with-deadline (:seconds timeout)
        (let* ((source (tls-wire-source client))
               (response (read-wire-message source)))
          (when close
            (handler-case (expect-end source response)
              (wire-error (e)
                (if (search "timed out" (wire-error-message e))
                    (wire-fail source "the connection was still open ~D s after the message"
                               timeout)
                    (error e)))))
          response))
    (wire-error (e) e)))

;;; The server: GALLOP:EASY-SSL-ACCEPTOR, with the /wire-ok handler of
;;; core/answers.lisp (an easy handler: every easy acceptor dispatches it).

(defun call-with-tls-front-end (options function)
  "Start GALLOP:EASY-SSL-ACCEPTOR with a GALLOP:TASKMASTER made with OPTIONS
\(as CALL-WITH-FRONT-END: limits, timeouts), call FUNCTION with its port
and the acceptor, and always stop it."
  (let ((server (make-ssl-server 'gallop:easy-ssl-acceptor
                                 :taskmaster (apply #'make-instance 'gallop:taskmaster options))))
    (hunchentoot:start server)
    (unwind-protect (funcall function (port-of server) server)
      (when (hunchentoot:started-p server)
        (hunchentoot:stop server)))))

;;; Segmentation: the limits of core/answers.lisp, over TLS

(defun check-tls-limits-whatever-the-split ()
  "LIMIT-CASES for each of *LIMIT-SETS* over TLS, split as there: the same
status however the plaintext is cut into TLS records."
  (loop for ((line head body) splits) in *limit-sets*
        do (call-with-tls-front-end
            (list :max-request-line-bytes line :max-head-bytes head :max-body-bytes body)
            (lambda (port server)
              (declare (ignore server))
              (loop for (name status text body-length) in (limit-cases line head body)
                    do (dolist (split splits)
                         (let ((what (format nil "TLS, limits ~D/~D/~D, ~A, sent ~(~A~)"
                                             line head body name split))
                               (client (tls-connect port)))
                           (unwind-protect
                                (progn
                                  (ecase split
                                    (:whole (tls-send client (octets text)))
                                    (:kib (tls-send client (octets text) :piece 1024 :pause 0.005))
                                    (:byte (tls-send client (octets text) :piece 1 :pause 0.0002)))
                                  ;; (TLS-READ-WIRE :CLOSE checked the end already.)
                                  (check-limit-answer
                                   what (tls-read-wire client :close (/= status 200))
                                   status body-length #'identity))
                             (tls-close client)))))))))

(test limits-do-not-depend-on-segmentation-tls
  (check-tls-limits-whatever-the-split))

;;; Keep-alive and pipelining

(test tls-pipelined-requests-and-idle-keep-alive-are-served
  ;; Idle timeout 3 s: a pipelined request left unseen would be found out by
  ;; the connection closing then, well within the reader's 5 s.
  (call-with-tls-front-end
   '(:idle-timeout 3)
   (lambda (port server)
     (let ((client (tls-connect port)))
       (unwind-protect
            (progn
              ;; Two requests, one with a body, in one TLS record: the server
              ;; reads the first head a byte at a time, OpenSSL decrypts the
              ;; whole record, and the rest waits in OpenSSL's buffer.
              (is (tls-send client (octets (concatenate 'string
                                                        (request-with-body 5)
                                                        (crlf "GET /wire-ok HTTP/1.1" "Host: x")))))
              (check-ok-answer "TLS, first pipelined request" (tls-read-wire client) 5)
              (check-ok-answer "TLS, second pipelined request" (tls-read-wire client) 0)
              ;; The connection idles: the server waits for the next request
              ;; without counting it as in flight.
              (is (wait-until (lambda () (zerop (stat server :in-flight))) :timeout 5)
                  "the idle TLS connection still counts as in flight: ~S" (gallop:stats server))
              (is (tls-send client (octets (crlf "GET /wire-ok?third HTTP/1.1" "Host: x"))))
              (check-ok-answer "TLS, request after the idle time" (tls-read-wire client) 0)
              ;; close_notify is the client's end of file: the server closes too.
              (is (tls-end-output client))
              (multiple-value-bind (rest end) (tls-read-to-end client :timeout 5)
                (is (zerop (length rest)) "bytes after the last answer: ~S" rest)
                (is (null end) "the connection ended with ~S, not the server's close" end)))
         (tls-close client))))))

;;; Deadlines inside TLS: the TLS library turns a condition raised under it
;;; into an error of its own; Gallop gives it back its meaning.

(test tls-handler-deadline-while-reading-a-body-gets-503
  ;; A handler blocked reading a body that never comes, cut by its deadline:
  ;; 503, as on a plain socket (not a silent close counted as an abort).
  ;; (The body is streamed to the handler: one read first would hold it.)
  (call-with-tls-front-end
   (list :handler-timeout 1 :streamed-bodies (constantly t))
   (lambda (port server)
     (let ((client (tls-connect port)))
       (unwind-protect
            (progn
              (tls-send client (octets (concatenate 'string
                                                    (crlf "POST /body HTTP/1.1" "Host: x"
                                                          "Content-Length: 10")
                                                    "abc")))
              (let ((response (tls-read-wire client :close t :timeout 8)))
                (is (and (wire-response-p response) (= 503 (wire-status response)))
                    "~A" response))
              (is (zerop (stat server :aborted))))
         (tls-close client))))))

(test a-dribbled-tls-handshake-ends-at-the-header-timeout
  ;; The handshake is bounded like a head: a client sending its ClientHello
  ;; an octet a second loses its connection at the header timeout (2 s),
  ;; though each octet comes well within the read timeout (20 s).
  (let ((server (make-ssl-server 'gallop:easy-ssl-acceptor
                                 :taskmaster (make-instance 'gallop:taskmaster :header-timeout 2))))
    (hunchentoot:start server)
    (unwind-protect
         (let ((socket (connect (port-of server)))
               (hello (tls-client-hello-start))
               (start (get-internal-real-time)))
           (unwind-protect
                (let ((stream (usocket:socket-stream socket)))
                  (loop for octet across hello
                        do (handler-case (progn (write-byte octet stream) (force-output stream))
                             (error () (return)))
                           (sleep 1)
                           (when (> (- (get-internal-real-time) start)
                                    (* 8 internal-time-units-per-second))
                             (return)))
                  (is (wait-until (lambda () (zerop (stat server :open))) :timeout 10)
                      "the dribbling client still holds a connection: ~S" (gallop:stats server))
                  (is (plusp (stat server :timeouts))))
             (ignore-errors (usocket:socket-close socket)))) ; its last octet may be unsent
      (hunchentoot:stop server))))

(test tls-head-buffers-count-against-the-head-budget
  ;; As on a plain socket (core/budget.lisp): a buffer grown for a long head
  ;; over TLS is charged; past the budget the next one gets 503.
  (call-with-tls-front-end
   '(:head-budget 65536)
   (lambda (port server)
     (let ((first (tls-connect port))
           (second nil)
           ;; a head with a long field, not yet ended by its empty line
           (open-head (format nil "GET /wire-ok HTTP/1.1~C~CHost: x~C~CX-Long: ~A"
                              #\Return #\Linefeed #\Return #\Linefeed
                              (make-string 40000 :initial-element #\a))))
       (unwind-protect
            (progn
              (tls-send first (octets open-head))
              (is (wait-until (lambda () (= 65536 (stat server :head-bytes))) :timeout 10)
                  "head bytes ~S" (stat server :head-bytes))
              (setf second (tls-connect port))
              (tls-send second (octets open-head))
              (let ((response (tls-read-wire second :close t :timeout 8)))
                (is (and (wire-response-p response) (= 503 (wire-status response))) "~A" response))
              ;; the first ends its head and is served; the budget comes back
              (tls-send first (octets (format nil "~C~C~C~C" #\Return #\Linefeed #\Return #\Linefeed)))
              (let ((response (tls-read-wire first :timeout 8)))
                (is (and (wire-response-p response) (= 200 (wire-status response))) "~A" response))
              (tls-close first)
              (is (wait-until (lambda () (zerop (stat server :head-bytes))) :timeout 10)))
         (tls-close first)
         (when second (tls-close second)))))))
