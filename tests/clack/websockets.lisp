;;;; websockets.lisp -- websocket-driver on Clack :gallop and hunchensocket's
;;;; README chat on GALLOP:EASY-ACCEPTOR and on a stock acceptor with
;;;; GALLOP:TASKMASTER, unchanged, in a child process
;;;; (tests/child/ws-server.lisp), driven over real sockets: frames sent and
;;;; checked byte by byte, and Debian's python3-websockets as a real client.

(in-package #:gallop-tests)

(in-suite native)

(defvar *ws-child* nil "The child process serving the WebSocket libraries.")
(defvar *ws-ports* nil "Its ports: (clack easy taskmaster capped).")

(defun ws-child-stderr () #p"/tmp/gallop-ws-child.err")

(defun start-ws-child ()
  "Start tests/child/ws-server.lisp, which loads the WebSocket libraries
through ASDF as this process would find them.  Its first start compiles
Clack, websocket-driver and hunchensocket: up to minutes."
  (let* ((root (asdf:system-source-directory "gallop"))
         (process (sb-ext:run-program
                   "sbcl" (list "--noinform" "--non-interactive" "--no-userinit"
                                "--eval" "(require :asdf)"
                                "--eval" "(push (uiop:getcwd) asdf:*central-registry*)"
                                "--eval" "(setf *compile-verbose* nil *compile-print* nil)"
                                "--load" "tests/child/ws-server.lisp")
                   :search t :wait nil :input :stream :output :stream
                   :error (namestring (ws-child-stderr)) :if-error-exists :supersede
                   :directory (namestring root)))
         (output (sb-ext:process-output process))
         (line (and (sb-sys:wait-until-fd-usable (sb-sys:fd-stream-fd output) :input 600)
                    (read-line output nil ""))))
    (setf *ws-child* process)
    (if (and line (uiop:string-prefix-p "READY " line))
        (setf *ws-ports* (with-input-from-string (in line :start 6)
                           (list (read in) (read in) (read in) (read in))))
        (error "The WebSocket child did not start:~%~A"
               (uiop:read-file-string (ws-child-stderr))))))

(defun ws-child-command (command)
  (let ((in (sb-ext:process-input *ws-child*)))
    (write-line command in)
    (finish-output in)
    (read-line (sb-ext:process-output *ws-child*))))

(defun end-ws-child ()
  (when *ws-child*
    (ignore-errors (ws-child-command "quit"))
    (unless (wait-until (lambda () (not (sb-ext:process-alive-p *ws-child*))) :timeout 10)
      (ignore-errors (sb-ext:process-kill *ws-child* 9)))
    (ignore-errors (sb-ext:process-close *ws-child*))
    (setf *ws-child* nil)))

(defmacro with-ws-child (() &body body)
  "Run BODY with the child serving the WebSocket libraries (*WS-PORTS*);
skip the test when ASDF cannot find them."
  `(with-optional-systems ("clack" "clack-socket" "websocket-driver" "hunchensocket")
     (start-ws-child)
     (unwind-protect (progn ,@body) (end-ws-child))))

;;; A client, byte by byte

(defparameter *rfc-key* "dGhlIHNhbXBsZSBub25jZQ=="
  "The Sec-WebSocket-Key of RFC 6455, 1.3; its accept value is +RFC-ACCEPT+.")
(defparameter *rfc-accept* "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")

(defun ws-handshake (path &rest extra)
  (apply #'crlf (format nil "GET ~A HTTP/1.1" path) "Host: 127.0.0.1" "Upgrade: websocket"
         "Connection: Upgrade" (format nil "Sec-WebSocket-Key: ~A" *rfc-key*)
         "Sec-WebSocket-Version: 13" extra))

(defun server-frame (opcode payload)
  "A frame as a server sends it: final, unmasked."
  (ws-frame opcode payload :mask nil))

(defun read-octets (socket n &key (timeout 10))
  (let ((stream (usocket:socket-stream socket))
        (out (make-array n :element-type '(unsigned-byte 8))))
    (setf (sb-impl::fd-stream-timeout stream) (float timeout 1.0))
    (let ((got (handler-case (read-sequence out stream) (sb-sys:io-timeout () 0))))
      (subseq out 0 got))))

(defun read-ws-head (socket)
  "The handshake's answer: status and headers (the strict reader of strict-reader.lisp)."
  (let ((source (stream-source (usocket:socket-stream socket))))
    (multiple-value-bind (status fields) (read-101-head source)
      (values status fields))))

(defun read-101-head (source)
  (let* ((line (wire-read-line source "status line"))
         (status (nth-value 0 (parse-status-line source line)))
         (fields (read-field-section source "field")))
    (values status fields)))

(defun field (fields name)
  (cdr (assoc name fields :test #'string-equal)))

(defun open-ws (port path &rest extra)
  "A connection to PORT with the handshake for PATH done: the socket and the
answer's headers.  Fails the test unless the answer is 101 with the accept
value of +RFC-KEY+."
  (let ((socket (connect port)))
    (send socket (apply #'ws-handshake path extra))
    (multiple-value-bind (status fields) (read-ws-head socket)
      (is (eql 101 status))
      (is (equal *rfc-accept* (field fields "Sec-WebSocket-Accept")))
      (values socket fields))))

(defun expect-octets (socket expected what)
  "The next octets from SOCKET are EXPECTED (a sequence of octets), compared
as vectors: a message of 16 MiB as a list would be 512 MiB of conses, half
the test image's heap."
  (let* ((expected (coerce expected '(simple-array (unsigned-byte 8) (*))))
         (got (read-octets socket (length expected))))
    (is (equalp expected got)
        "~A: expected ~D octets, got ~D, the first difference at ~S: ~S" what
        (length expected) (length got) (mismatch expected got)
        (subseq got 0 (min 40 (length got))))))

(defun ws-send (socket octets &key one-by-one)
  (let ((stream (usocket:socket-stream socket)))
    (if one-by-one
        (loop for b across octets do (write-byte b stream) (force-output stream))
        (progn (write-sequence octets stream) (force-output stream)))))

(defun ws-close-payload (code &optional (reason ""))
  (concat-octets (vector (ldb (byte 8 8) code) (ldb (byte 8 0) code)) (octets reason)))

(defun check-websocket-driver-echo (port &key one-by-one)
  "websocket-driver's echo at /echo: the exact 101, then each frame's answer
byte for byte."
  (let ((socket (connect port)))
    (unwind-protect
         (progn
           (ws-send socket (octets (ws-handshake "/echo")) :one-by-one one-by-one)
           (expect-octets socket (octets (crlf "HTTP/1.1 101 Switching Protocols"
                                               "Upgrade: websocket" "Connection: Upgrade"
                                               (format nil "Sec-WebSocket-Accept: ~A" *rfc-accept*)))
                          "the handshake")
           ;; text, binary, and a binary with a 16-bit length
           (ws-send socket (ws-frame 1 (octets "hello")) :one-by-one one-by-one)
           (expect-octets socket (server-frame 1 (octets "hello")) "text")
           (ws-send socket (ws-frame 2 #(0 1 2 255)) :one-by-one one-by-one)
           (expect-octets socket (server-frame 2 #(0 1 2 255)) "binary")
           (unless one-by-one
             (let ((big (make-array 70000 :element-type '(unsigned-byte 8))))
               (dotimes (i 70000) (setf (aref big i) (mod (* i 7) 256)))
               (ws-send socket (ws-frame 2 big))
               (expect-octets socket (server-frame 2 big) "70,000 octets")))
           ;; a fragmented text with a ping between its fragments
           (ws-send socket (concat-octets (ws-frame 1 (octets "frag") :fin nil)
                                              (ws-frame 9 (octets "p!"))
                                              (ws-frame 0 (octets "ment")))
                        :one-by-one one-by-one)
           (expect-octets socket (concat-octets (server-frame 10 (octets "p!"))
                                                (server-frame 1 (octets "fragment")))
                          "a pong, then the whole message")
           ;; the close handshake: the code back, then the end of the connection
           (ws-send socket (ws-frame 8 (ws-close-payload 4000 "bye")) :one-by-one one-by-one)
           (expect-octets socket (server-frame 8 (ws-close-payload 4000 "bye")) "close")
           (is (closed-by-peer-p socket)))
      (usocket:socket-close socket))))

(defun check-hunchensocket-chat (port)
  "hunchensocket's README chat: two users in /bongo see each other join,
talk and leave, byte for byte; the server then closes."
  (let ((alice (open-ws port "/bongo" "User-Agent: alice")))
    (unwind-protect
         (progn
           (expect-octets alice (server-frame 1 (octets "alice has joined /bongo")) "alice joins")
           (let ((bob (open-ws port "/bongo" "User-Agent: bob")))
             (unwind-protect
                  (progn
                    (expect-octets alice (server-frame 1 (octets "bob has joined /bongo")) "bob joins")
                    (expect-octets bob (server-frame 1 (octets "bob has joined /bongo")) "bob sees")
                    (ws-send alice (ws-frame 1 (octets "hi")))
                    (expect-octets alice (server-frame 1 (octets "alice says hi")) "alice's")
                    (expect-octets bob (server-frame 1 (octets "alice says hi")) "to bob")
                    (ws-send bob (ws-frame 8 (ws-close-payload 1000)))
                    (expect-octets bob (server-frame 8 (ws-close-payload 1000)) "bob's close")
                    (is (closed-by-peer-p bob)))
               (usocket:socket-close bob)))
           (expect-octets alice (server-frame 1 (octets "bob has left /bongo")) "bob left")
           ;; Plain HTTP meanwhile, on the same acceptor.
           (is (member (response-status (get-request port "/plain")) '(200 404)))
           (ws-send alice (ws-frame 8 (ws-close-payload 1000)))
           (expect-octets alice (server-frame 8 (ws-close-payload 1000)) "alice's close")
           (is (closed-by-peer-p alice)))
      (usocket:socket-close alice))))

(defun python-websockets (script &rest args)
  "Run Debian's python3-websockets client SCRIPT (tests/clients/) with ARGS:
its output lines."
  (let ((output (with-output-to-string (out)
                  (sb-ext:run-program "/usr/bin/python3"
                                      (list* (namestring (merge-pathnames
                                                          (format nil "tests/clients/~A" script)
                                                          (asdf:system-source-directory "gallop")))
                                             (mapcar #'princ-to-string args))
                                      :output out :error out :wait t))))
    (uiop:split-string (string-right-trim '(#\Newline) output) :separator '(#\Newline))))

(defun check-switched-cap (port)
  "With :MAX-SWITCHED-THREADS 2, a third hunchensocket WebSocket is answered
503 (and the connection keeps serving HTTP); once one closes, a new one is
taken again."
  (let ((one (open-ws port "/fury" "User-Agent: one"))
        (two nil))
    (unwind-protect
         (progn
           (expect-octets one (server-frame 1 (octets "one has joined /fury")) "one joins")
           (setf two (open-ws port "/fury" "User-Agent: two"))
           (expect-octets two (server-frame 1 (octets "two has joined /fury")) "two joins")
           (expect-octets one (server-frame 1 (octets "two has joined /fury")) "one sees two")
           (let ((third (connect port)))
             (unwind-protect
                  (progn
                    (send third (ws-handshake "/fury" "User-Agent: three"))
                    (let ((response (read-response third)))
                      (is (= 503 (response-status response)))
                      (is (equal "1" (header response :retry-after)))
                      (is (string= (format nil "503 Service Unavailable~%") (body-string response)))))
               (usocket:socket-close third)))
           (ws-send one (ws-frame 8 (ws-close-payload 1000)))
           (expect-octets one (server-frame 8 (ws-close-payload 1000)) "one's close")
           (is (closed-by-peer-p one))
           (is (wait-until
                (lambda ()
                  (let ((socket (connect port)))
                    (unwind-protect
                         (progn (send socket (ws-handshake "/fury" "User-Agent: four"))
                                (let ((response (read-response socket :head-only t)))
                                  (and response (eql 101 (response-status response)))))
                      (usocket:socket-close socket)))))
               "no WebSocket taken again after one closed"))
      (usocket:socket-close one)
      (when two (usocket:socket-close two)))))

(test websocket-libraries-unchanged
  "websocket-driver on Clack :gallop, hunchensocket on both Hunchentoot front
ends: handshakes, messages, fragments, pings, closes byte for byte; a real
client; no fd left once every WebSocket closed."
  (with-ws-child ()
    (destructuring-bind (clack easy taskmaster capped) *ws-ports*
      (let ((fds (parse-integer (ws-child-command "fds"))))
        (check-websocket-driver-echo clack)
        (check-websocket-driver-echo clack :one-by-one t)
        (is (string= "plain" (body-string (get-request clack "/plain"))))
        (check-hunchensocket-chat easy)
        (check-hunchensocket-chat taskmaster)
        (is (equal '("text hello" "binary 000102ff" "big 16777216 True" "pong"
                     "closed 4000 bye" "chat hello from a" "chat hello from a")
                   (python-websockets "ws-client.py" clack)))
        (check-switched-cap capped)
        (is (wait-until (lambda () (<= (parse-integer (ws-child-command "fds")) fds))
                        :timeout 10)
            "the child holds more fds than before the WebSockets: ~A > ~D"
            (ws-child-command "fds") fds)))))
