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
  (list (make-instance 'frame-room :name "/bongo") (make-instance 'frame-room :name "/fury")))

(defclass frame-acceptor-mixin () ()
  (:default-initargs :request-class 'frame-request)
  (:documentation "Answers 101 to a WebSocket handshake on a room's path, else 404."))

(defclass frame-easy-acceptor (frame-acceptor-mixin gallop:easy-acceptor) ())
(defclass frame-stock-acceptor (frame-acceptor-mixin hunchentoot:acceptor) ())

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
      (funcall 'hunchentoot::set-timeouts *frame-socket* 30 30)
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
