;;;; switched.lisp -- a Hunchentoot handler that answers 101 and then reads
;;;; the new protocol from the request's stream in its own loop, in the shape
;;;; hunchensocket gives it (a request class whose PROCESS-REQUEST :AFTER
;;;; takes the stream, SET-TIMEOUTS on the connection's usocket, writes to
;;;; other clients from the sender's thread), on GALLOP:EASY-ACCEPTOR and on
;;;; a stock acceptor with GALLOP:TASKMASTER.  Gallop and Hunchentoot alone:
;;;; the same checks run hunchensocket itself where ASDF finds it
;;;; (clack/websockets.lisp).  The protocol is a chat over RFC 6455 frames,
;;;; kept to what the checks send: text and close frames of under 126 octets.

(in-package #:gallop-tests)

(in-suite gallop)

(defvar *frame-socket* nil "The usocket PROCESS-CONNECTION was given.")

(defclass frame-request (hunchentoot:request) ()
  (:documentation "A request whose PROCESS-REQUEST :AFTER may keep its stream."))

(defclass frame-room ()
  ((name :initarg :name :reader room-name)
   (clients :initform '() :accessor room-clients)
   (lock :initform (sb-thread:make-mutex :name "room") :reader room-lock)))

(defclass frame-client ()
  ((name :initarg :name :reader client-name)
   (stream :initarg :stream :reader client-stream)
   (lock :initform (sb-thread:make-mutex :name "client writes") :reader client-lock)))

(defvar *frame-rooms*
  (list (make-instance 'frame-room :name "/bongo") (make-instance 'frame-room :name "/fury")
        (make-instance 'frame-room :name "/tls")))

(defclass frame-acceptor-mixin ()
  ((frame-timeout :initarg :frame-timeout :initform 30 :reader frame-timeout))
  (:default-initargs :request-class 'frame-request)
  (:documentation "Answers 101 to a WebSocket handshake on a room's path, else 404.
Its handlers set FRAME-TIMEOUT as their stream's timeouts (NIL: none)."))

(defclass frame-easy-acceptor (frame-acceptor-mixin gallop:easy-acceptor) ())
(defclass frame-stock-acceptor (frame-acceptor-mixin hunchentoot:acceptor) ())
(defclass frame-easy-ssl-acceptor (frame-acceptor-mixin gallop:easy-ssl-acceptor) ())
(defclass frame-stock-ssl-acceptor (frame-acceptor-mixin hunchentoot:ssl-acceptor) ())

(defmethod hunchentoot:process-connection :around ((acceptor frame-acceptor-mixin) socket)
  (let ((*frame-socket* socket))
    (call-next-method)))

(defun frame-room-of (request)
  (find (hunchentoot:script-name request) *frame-rooms* :key #'room-name :test #'string=))

(defmethod hunchentoot:acceptor-dispatch-request ((acceptor frame-acceptor-mixin) request)
  (let ((key (hunchentoot:header-in :sec-websocket-key request)))
    (if (and key (frame-room-of request))
        (progn
          (setf (hunchentoot:return-code*) 101
                (hunchentoot:header-out :upgrade) "websocket"
                (hunchentoot:header-out :connection) "Upgrade"
                (hunchentoot:header-out :sec-websocket-accept)
                (gallop::base64-encode
                 (gallop::sha1 (octets (concatenate 'string key
                                                    "258EAFA5-E914-47DA-95CA-C5AB0DC85B11")))))
          "")
        (progn (setf (hunchentoot:return-code*) 404) "none"))))

(defun write-server-frame (client opcode payload)
  "One final, unmasked frame to CLIENT, whole, from any thread."
  (let ((stream (client-stream client)))
    (sb-thread:with-mutex ((client-lock client))
      (write-byte (logior #x80 opcode) stream)
      (write-byte (length payload) stream)
      (write-sequence payload stream)
      (force-output stream))))

(defun room-broadcast (room control &rest args)
  (let ((payload (octets (apply #'format nil control args))))
    (dolist (peer (sb-thread:with-mutex ((room-lock room)) (copy-list (room-clients room))))
      (ignore-errors (write-server-frame peer 1 payload)))))

(defun read-client-frame (stream)
  "The opcode and unmasked payload of the next frame a client sends."
  (let* ((opcode (logand (read-byte stream) #x0f))
         (n (logand (read-byte stream) #x7f))
         (mask (loop repeat 4 collect (read-byte stream)))
         (payload (make-array n :element-type '(unsigned-byte 8))))
    (dotimes (i n)
      (setf (aref payload i) (logxor (read-byte stream) (nth (mod i 4) mask))))
    (values opcode payload)))

(defmethod hunchentoot:process-request :after ((request frame-request))
  (when (eql 101 (hunchentoot:return-code*))
    (let* ((stream (hunchentoot::content-stream request))
           (room (frame-room-of request))
           (client (make-instance 'frame-client :stream stream
                                                :name (hunchentoot:header-in :user-agent request))))
      (force-output stream)
      (let ((timeout (frame-timeout hunchentoot:*acceptor*)))
        (when timeout
          (funcall 'hunchentoot::set-timeouts *frame-socket* timeout timeout)))
      (sb-thread:with-mutex ((room-lock room)) (push client (room-clients room)))
      (unwind-protect
           (progn
             (room-broadcast room "~A has joined ~A" (client-name client) (room-name room))
             (handler-case
                 (loop (multiple-value-bind (opcode payload) (read-client-frame stream)
                         (case opcode
                           (1 (room-broadcast room "~A says ~A" (client-name client)
                                              (map 'string #'code-char payload)))
                           (8 (write-server-frame client 8 payload)
                            (return)))))
               ((or end-of-file stream-error) () nil)))
        (sb-thread:with-mutex ((room-lock room))
          (setf (room-clients room) (remove client (room-clients room))))
        (room-broadcast room "~A has left ~A" (client-name client) (room-name room))))))

(test a-handler-that-reads-frames-after-its-101
  "The chat, byte for byte, on GALLOP:EASY-ACCEPTOR and on a stock acceptor
with GALLOP:TASKMASTER; with :MAX-SWITCHED-THREADS 2, a third 101 is 503
and one is taken again once one closed; no fd left after."
  (let ((fds (fd-count)))
    (dolist (server (list (make-server 'frame-easy-acceptor)
                          (make-server 'frame-stock-acceptor
                                       :taskmaster (make-instance 'gallop:taskmaster))))
      (hunchentoot:start server)
      (unwind-protect (check-hunchensocket-chat (port-of server))
        (hunchentoot:stop server)))
    (let ((capped (make-server 'frame-easy-acceptor
                               :taskmaster (make-instance 'gallop:taskmaster
                                                          :max-switched-threads 2))))
      (hunchentoot:start capped)
      (unwind-protect (check-switched-cap (port-of capped))
        (hunchentoot:stop capped)))
    (is (wait-until (lambda () (<= (fd-count) fds))) "fds: ~D before, ~D after" fds (fd-count))))

;;; What a switched connection costs, and how long it may stay silent

(test switched-threads-charge-their-stacks-to-the-memory-account
  "Each switched connection charges its thread's stacks (THREAD-OCTETS) to
the memory account as it switches, and gives them back when it ends; a 101
the account cannot take is answered 503 with Retry-After, and the
connection's client reads that whole answer."
  (with-server (server 'frame-easy-acceptor)
    (let* ((port (port-of server))
           ;; THREAD-OCTETS (account.lisp, internal): what the account
           ;; charges for a thread's stacks, the charge under test.
           (cost (gallop.core::thread-octets))
           (before (memory-used :stacks))
           (one (open-ws port "/fury" "User-Agent: one")))
      (unwind-protect
           (progn
             (expect-octets one (server-frame 1 (octets "one has joined /fury")) "one joins")
             (is (= (+ before cost) (memory-used :stacks))
                 "charged ~D octets for one switched thread, not ~D"
                 (- (memory-used :stacks) before) cost)
             ;; Room for this one, not for a second: the stacks' limit is
             ;; under twice what they count now.
             (with-memory-limit (nil :stacks (+ (memory-used :stacks) cost -1))
               (is (< (overload-level-now) 2))
               (let ((two (connect port)))
                 (unwind-protect
                      (progn
                        (send two (ws-handshake "/fury" "User-Agent: two"))
                        (let ((response (read-response two)))
                          (is (eql 503 (and response (response-status response))))
                          (is (equal "1" (and response (header response :retry-after))))
                          (is (equal (format nil "503 Service Unavailable~%")
                                     (and response (body-string response))))))
                   (usocket:socket-close two)))
               (is (= (+ before cost) (memory-used :stacks))
                   "the refused one left ~D octets charged"
                   (- (memory-used :stacks) before cost)))
             (ws-send one (ws-frame 8 (ws-close-payload 1000)))
             (expect-octets one (server-frame 8 (ws-close-payload 1000)) "one's close")
             (is (closed-by-peer-p one))
             (is (wait-until (lambda () (= before (memory-used :stacks))))
                 "~D octets still charged once the switched connection ended"
                 (- (memory-used :stacks) before)))
        (usocket:socket-close one)))))

(defun check-silent-switched-closed (server)
  "A client of SERVER's /bongo that sends nothing after the room's greeting
reads the end of the connection (its handler's read timed out), within a
few seconds, and the server counts a timeout."
  (hunchentoot:start server)
  (unwind-protect
       (let ((socket (open-ws (port-of server) "/bongo" "User-Agent: mute")))
         (unwind-protect
              (progn
                (expect-octets socket (server-frame 1 (octets "mute has joined /bongo"))
                               "the greeting")
                (is (closed-by-peer-p socket :timeout 10)
                    "a silent switched WebSocket was not closed within 10 s")
                (is (plusp (stat server :timeouts))))
           (usocket:socket-close socket)))
    (hunchentoot:stop server)))

(test a-silent-switched-websocket-is-closed
  "A switched connection's reads wait for the timeout its handler set
\(Hunchentoot's SET-TIMEOUTS, as hunchensocket does); without one, for
UPGRADED-IDLE-TIMEOUT, the idle timeout of WebSockets; without that, for
READ-TIMEOUT.  Each of the three set to 1 s, the others long."
  (check-silent-switched-closed
   (make-server 'frame-easy-acceptor :frame-timeout 1
                :taskmaster (make-instance 'gallop:taskmaster :read-timeout 600
                                                              :upgraded-idle-timeout 600)))
  (check-silent-switched-closed
   (make-server 'frame-easy-acceptor :frame-timeout nil
                :taskmaster (make-instance 'gallop:taskmaster :read-timeout 600
                                                              :upgraded-idle-timeout 1)))
  (check-silent-switched-closed
   (make-server 'frame-easy-acceptor :frame-timeout nil
                :taskmaster (make-instance 'gallop:taskmaster :read-timeout 1
                                                              :upgraded-idle-timeout nil))))

;;; The chat over the engine's own TLS, where the threads of the room write
;;; to a connection while its handler's thread reads it: every client sends
;;; its messages back to back, all at once.

(defun open-tls-frames (port path name)
  "A TLS connection to PORT with the WebSocket handshake for PATH done as
NAME (its User-Agent): the socket, its TLS stream, and the answer's status
line."
  (let* ((socket (connect port :timeout 30))
         (tls (cl+ssl:make-ssl-client-stream (usocket:socket-stream socket) :verify nil)))
    (write-sequence (octets (ws-handshake path (format nil "User-Agent: ~A" name))) tls)
    (force-output tls)
    (let ((status (read-line-crlf tls)))
      (loop for line = (read-line-crlf tls) until (or (null line) (zerop (length line))))
      (values socket tls status))))

(defun read-tls-frame (tls)
  "The next frame the server sends on TLS, as its first octet and its
payload (a string); a length of 126 or more (not one the chat sends) is
read as a one-octet one."
  (let* ((first (read-byte tls))
         (payload (make-array (logand (read-byte tls) #x7f) :element-type '(unsigned-byte 8))))
    (unless (= (read-sequence payload tls) (length payload))
      (error "end of file in a frame"))
    (values first (map 'string #'code-char payload))))

(defun tls-chat-client (name tls names count)
  "What the client NAME reads on TLS while it sends COUNT messages, each
once the room said its last: the texts of the frames (a frame that is not
a single text frame as a list of its first octet and its text), up to all
the messages of NAMES; or (:FAILED message frames-read first-frames)."
  (let ((got '())
        (n 0)
        (total (* count (length names))))
    (flet ((take ()
             (multiple-value-bind (first text) (read-tls-frame tls)
               (incf n)
               (car (push (if (= first #x81) text (list first text)) got)))))
      (handler-case
          (progn
            (dotimes (i count)
              (write-sequence (ws-frame 1 (octets (format nil "~A ~D" name i))) tls)
              (force-output tls)
              (loop with own = (format nil "~A says ~A ~D" name name i)
                    until (or (>= n total) (equal own (take)))))
            (loop while (< n total) do (take))
            (nreverse got))
        (error (e)
          (list* :failed (princ-to-string e) n (reverse (subseq got 0 (min 3 n)))))))))

(defun check-tls-chat-client (name got names count)
  "Check what the client NAME read (see TLS-CHAT-CLIENT): all the messages
of NAMES, each sender's in order, and nothing else."
  (if (member (first got) '(:failed :timeout))
      (is nil "~A: ~S" name got)
      (progn
        (is (= (* count (length names)) (length got))
            "~A read ~D messages, not ~D" name (length got) (* count (length names)))
        (dolist (sender names)
          (let ((expected (loop for i below count collect (format nil "~A says ~A ~D" sender sender i)))
                (from (remove-if-not (lambda (m)
                                       (and (stringp m)
                                            (uiop:string-prefix-p (format nil "~A says " sender) m)))
                                     got)))
            (is (equal expected from)
                "~A, from ~A: ~D messages; the first wrong: ~S" name sender (length from)
                (let ((at (mismatch expected from :test #'equal)))
                  (and at (nth at from)))))))))

(defun check-tls-chat (port &key (names '("ann" "bea" "cid")) (count 200))
  "NAMES join /tls in turn; then, all at once, each sends COUNT messages,
the next once the room said the last (so each handler's thread waits in
its read between two while the others write to its connection), and reads
what the room says."
  (let ((clients '()))
    (unwind-protect
         (progn
           (dolist (name names)
             (multiple-value-bind (socket tls status) (open-tls-frames port "/tls" name)
               (setf clients (append clients (list (list name socket tls))))
               (is (equal "HTTP/1.1 101 Switching Protocols" status) "~A: ~S" name status)
               (loop for (nil nil stream) in clients
                     do (is (equal (format nil "~A has joined /tls" name)
                                   (nth-value 1 (read-tls-frame stream)))))))
           (let* ((go (sb-thread:make-semaphore))
                  (threads (loop for (name nil tls) in clients
                                 collect (let ((name name) (tls tls))
                                           (sb-thread:make-thread
                                            (lambda ()
                                              (sb-thread:wait-on-semaphore go)
                                              (tls-chat-client name tls names count))
                                            :name (format nil "TLS chat client ~A" name))))))
             (sb-thread:signal-semaphore go (length threads))
             (loop for thread in threads
                   for (name socket) in clients
                   do (let ((got (sb-thread:join-thread thread :default :timeout :timeout 120)))
                        (when (eq got :timeout)
                          ;; Wake a client blocked in its read.
                          (ignore-errors (sb-bsd-sockets:socket-shutdown (usocket:socket socket)
                                                                         :direction :io))
                          (setf got (list* :timeout (sb-thread:join-thread thread :default nil))))
                        (check-tls-chat-client name got names count)))))
      (loop for (nil socket tls) in clients
            do (ignore-errors (close tls))
               (usocket:socket-close socket)))))

(test a-tls-chat-reads-and-writes-a-connection-from-several-threads
  "The chat on the engine's TLS, GALLOP:EASY-SSL-ACCEPTOR and a stock
SSL-ACCEPTOR with GALLOP:TASKMASTER: three clients send 200 messages each
while the others' handler threads read; each reads all 600 byte for byte,
and no connection is left once they went away."
  (dolist (server (list (make-ssl-server 'frame-easy-ssl-acceptor)
                        (make-ssl-server 'frame-stock-ssl-acceptor
                                         :taskmaster (make-instance 'gallop:taskmaster))))
    (hunchentoot:start server)
    (unwind-protect
         (progn (check-tls-chat (port-of server))
                (is (wait-until (lambda () (zerop (stat server :open))) :timeout 30)
                    "connections left open: ~S" (gallop:stats server)))
      (hunchentoot:stop server))))
