;;;; switched-server.lisp -- WebSockets in hunchensocket's shape on
;;;; GALLOP:EASY-ACCEPTOR, in a child process, for the stress tests of
;;;; switched threads: a handler that answers 101 and then reads frames from
;;;; the request's stream in its own loop, keeping its thread (as
;;;; tests/hunchentoot/switched.lisp's chat, with an echo instead of a room),
;;;; so that thousands of them can be held, and a crash ends only this
;;;; process.
;;;;
;;;;   scripts/lisp.sh --load tests/child/switched-server.lisp --end-toplevel-options [SETTINGS]
;;;;
;;;; (or sbcl itself, with the same options after --dynamic-space-size: the
;;;; memory account's limit, and so how many may switch, follows the heap).
;;;;
;;;; SETTINGS, when given, is a plist read as GALLOP:TASKMASTER's initargs
;;;; (":max-switched-threads 2").  Listens on 127.0.0.1 and a free port; /echo
;;;; answers each text frame with the same text; a handshake anywhere else
;;;; gets 404.  Talks to the test on standard input/output:
;;;;   prints "READY <port>" once it listens;
;;;;   "stats"       -> "STATS <plist>" (GALLOP:STATS);
;;;;   "maker"       -> "MAKER <ticks>": the CPU time (user + system, clock
;;;;                    ticks) the pool's maker thread has used;
;;;;   "heap"        -> "HEAP <octets>": dynamic space in use after a full GC;
;;;;   "quit" or end of file -> exits.

(load (merge-pathnames "protocol.lisp" *load-truename*))
(defpackage #:gallop-switched-server (:use #:common-lisp #:gallop-child))
(in-package #:gallop-switched-server)

(asdf:load-system "gallop")

(defvar *settings*
  (let ((text (second sb-ext:*posix-argv*)))
    (and text (let ((*read-eval* nil)) (read-from-string (format nil "(~A)" text))))))

(defvar *socket* nil "The usocket PROCESS-CONNECTION was given.")

(defclass echo-request (hunchentoot:request) ())

(defclass echo-acceptor (gallop:easy-acceptor) ()
  (:default-initargs :request-class 'echo-request))

(defmethod hunchentoot:process-connection :around ((acceptor echo-acceptor) socket)
  (let ((*socket* socket))
    (call-next-method)))

(defmethod hunchentoot:acceptor-dispatch-request ((acceptor echo-acceptor) request)
  (let ((key (hunchentoot:header-in :sec-websocket-key request)))
    (if (and key (string= "/echo" (hunchentoot:script-name request)))
        (progn
          (setf (hunchentoot:return-code*) 101
                (hunchentoot:header-out :upgrade) "websocket"
                (hunchentoot:header-out :connection) "Upgrade"
                (hunchentoot:header-out :sec-websocket-accept)
                (gallop::base64-encode
                 (gallop::sha1 (map '(vector (unsigned-byte 8)) #'char-code
                                    (concatenate 'string key
                                                 "258EAFA5-E914-47DA-95CA-C5AB0DC85B11")))))
          "")
        (progn (setf (hunchentoot:return-code*) 404) "none"))))

;;; What the handler does per message is hunchensocket's kind of work (not
;;; its code): a frame object made with MAKE-INSTANCE of a constant class,
;;; the payload read with READ-SEQUENCE, the text decoded and encoded by
;;; flexi-streams, and a generic function of the resource and client
;;; classes called with the message.  Each of those is a first call in a
;;; fresh image (a constructor, a dispatch cache to fill).

(defclass echo-frame ()
  ((opcode :initarg :opcode :reader frame-opcode)
   (length :initarg :length :reader frame-length)
   (mask :initarg :mask :reader frame-mask)
   (data :initform nil :accessor frame-data)))

(defclass echo-resource () ())
(defclass echo-client ()
  ((stream :initarg :stream :reader client-stream)
   (lock :initform (sb-thread:make-mutex :name "client writes") :reader client-lock)))

(defvar *resource* (make-instance 'echo-resource))

(defgeneric message-received (resource client text))

(defun write-frame (stream opcode payload)
  "One final, unmasked frame of under 126 octets."
  (write-byte (logior #x80 opcode) stream)
  (write-byte (length payload) stream)
  (write-sequence payload stream)
  (force-output stream))

(defmethod message-received ((resource echo-resource) (client echo-client) text)
  (sb-thread:with-mutex ((client-lock client))
    (write-frame (client-stream client) 1
                 (flexi-streams:string-to-octets text :external-format :utf-8))))

(defun read-frame (stream)
  "The next frame the client sends (of under 126 octets), its payload
unmasked."
  (let* ((opcode (logand (read-byte stream) #x0f))
         (n (logand (read-byte stream) #x7f))
         (mask (let ((key (make-array 4 :element-type '(unsigned-byte 8))))
                 (read-sequence key stream)
                 key))
         (frame (make-instance 'echo-frame :opcode opcode :length n :mask mask))
         (payload (make-array n :element-type '(unsigned-byte 8))))
    (unless (= n (read-sequence payload stream))
      (error 'end-of-file :stream stream))
    (dotimes (i n)
      (setf (aref payload i) (logxor (aref payload i) (aref mask (mod i 4)))))
    (setf (frame-data frame) payload)
    frame))

(defmethod hunchentoot:process-request :after ((request echo-request))
  (when (eql 101 (hunchentoot:return-code*))
    (let* ((stream (hunchentoot::content-stream request))
           (client (make-instance 'echo-client :stream stream)))
      (force-output stream)
      ;; hunchensocket's default WEBSOCKET-TIMEOUT.
      (funcall 'hunchentoot::set-timeouts *socket* 300 300)
      (handler-case
          (loop (let ((frame (read-frame stream)))
                  (case (frame-opcode frame)
                    (1 (message-received *resource* client
                                         (flexi-streams:octets-to-string
                                          (frame-data frame) :external-format :utf-8)))
                    (8 (write-frame stream 8 (frame-data frame))
                     (return)))))
        ((or end-of-file stream-error) () nil)))))

(defvar *acceptor*
  (hunchentoot:start
   (make-instance 'echo-acceptor
                  :address "127.0.0.1" :port 0
                  :access-log-destination nil :message-log-destination *error-output*
                  :taskmaster (apply #'make-instance 'gallop:taskmaster *settings*))))

(defun maker-ticks ()
  "User + system clock ticks of the thread the kernel names \"gallop maker\"."
  (dolist (dir (directory "/proc/self/task/*/") 0)
    (let ((comm (ignore-errors
                 (with-open-file (s (merge-pathnames "comm" dir)) (read-line s nil "")))))
      (when (equal comm "gallop maker")
        (let* ((stat (with-open-file (s (merge-pathnames "stat" dir)) (read-line s)))
               ;; Fields after the command's closing parenthesis: state is
               ;; field 3, utime 14, stime 15.
               (fields (uiop:split-string (subseq stat (+ 2 (position #\) stat :from-end t)))
                                          :separator " ")))
          (return (+ (parse-integer (nth 11 fields)) (parse-integer (nth 12 fields)))))))))

;; RAISE-FD-LIMIT (os/syscalls.lisp, internal): thousands of switched
;; connections need more fds than the default soft limit; no front end
;; raises it, so the core does not export it.
(gallop.core::raise-fd-limit)
(reply "READY ~D" (hunchentoot:acceptor-port *acceptor*))

(loop for line = (read-line *standard-input* nil)
      while line
      do (let ((command (string-trim " " line)))
           (cond ((string= command "stats")
                  (reply "STATS ~S" (gallop:stats *acceptor*)))
                 ((string= command "maker")
                  (reply "MAKER ~D" (maker-ticks)))
                 ((string= command "heap")
                  (sb-ext:gc :full t)
                  (reply "HEAP ~D" (sb-kernel:dynamic-usage)))
                 ((string= command "quit") (return)))))

(sb-ext:exit :code 0 :abort t)
