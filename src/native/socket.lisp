;;;; socket.lisp -- the connection under a request, taken by the app as a
;;;; socket once it switches protocols (a WebSocket library writes its 101
;;;; itself, then frames): the environment's :CLACK.IO, Clack's socket
;;;; protocol (the Clack handler defines CLACK.SOCKET's methods on it).
;;;;
;;;; The socket is the request's exchange.  The app takes it while it runs,
;;;; in its worker (setting the read callback or writing is taking it); once
;;;; the app returns, the connection waits in epoll between the client's
;;;; messages, and the read callback runs on a pool worker whenever octets
;;;; arrive (gallop.core's upgrade.lisp).  Writes and closes work from any
;;;; thread and never wait for the client.

(in-package #:gallop)

(defun env-socket (env)
  "The socket of the request whose environment is ENV (its :CLACK.IO)."
  (getf env :clack.io))

;;; Whole frames for a WebSocket library.  websocket-driver's parser (in
;;; fast-websocket) reads a frame split across two calls wrongly: it unmasks
;;; each part from the start of the masking key and, for a text or binary
;;; frame, keeps only the last part; its synchronous path reads whole frames
;;; from a stream, and so works.  On a socket taken for a WebSocket (the
;;; request asked for one) the read callback is given whole frames: a frame
;;; that arrives in parts waits in the socket's own buffer until it is
;;; complete.  A frame declaring more than +WHOLE-FRAME-LIMIT+ octets is
;;; passed on as it comes (its library refuses it, by its own limit).

(defconstant +whole-frame-limit+ (* 64 1024 1024)
  "The largest WebSocket frame a socket assembles before its read callback
sees it: websocket-driver's default maximum message length.")

(declaim (inline frame-size))
(defun frame-size (octets start end)
  "The octets of the WebSocket frame at START in OCTETS[START,END) (RFC 6455,
5.2: its head and payload), or NIL while its length (and, after a 16- or
64-bit one, its masking key) is not all there."
  (declare (type octets octets) (type fixnum start end))
  (multiple-value-bind (length mask-at) (frame-length octets start end)
    (when length
      (let ((mask (if (logbitp 7 (aref octets (1+ start))) 4 0)))
        ;; A 16- or 64-bit length counts once the masking key is here too.
        (when (or (= mask-at 2) (>= (- end start) (+ mask-at mask)))
          (+ mask-at mask length))))))

(defun whole-frames-end (octets start end)
  "The end of the whole WebSocket frames at the start of OCTETS[START,END),
the size of the incomplete one after them (NIL while its length is not
all there), and whether a close frame is among the whole ones.  A frame over
+WHOLE-FRAME-LIMIT+ counts as whole: it is not kept."
  (declare (type octets octets) (type fixnum start end))
  (let ((close nil))
    (loop
      (let ((size (frame-size octets start end)))
        (cond ((null size) (return (values start nil close)))
              ((> size +whole-frame-limit+) (return (values end nil close)))
              ((> (+ start size) end) (return (values start size close)))
              (t (when (= 8 (logand 15 (aref octets start)))
                   (setf close t))
                 (incf start size)))))))

(defstruct (frame-buffer (:constructor make-frame-buffer ()) (:copier nil) (:predicate nil))
  (octets (make-array 0 :element-type '(unsigned-byte 8)) :type octets)
  (fill 0 :type fixnum))

(defun frame-reader (callback on-close-frame &key (charge (constantly t)) (refused (constantly nil)))
  "A read callback that gives CALLBACK (called as the socket's read callback
is) only whole WebSocket frames, keeping a partial one until it is whole;
ON-CLOSE-FRAME is called (no argument) before it is given a close frame.
The buffer a partial frame waits in is counted with CHARGE (a function of
the octets it grows by, negative when it shrinks; NIL refuses): refused, it
drops what came and calls REFUSED."
  (let ((buffer (make-frame-buffer))
        (dead nil))                     ; refused once: nothing more is read
    (labels ((resize (size keep)
               ;; A buffer of SIZE octets for the partial frame, its first
               ;; KEEP octets kept; NIL when CHARGE refuses it.
               (let ((old (frame-buffer-octets buffer)))
                 (when (funcall charge (- size (length old)))
                   (let ((new (make-array size :element-type '(unsigned-byte 8))))
                     (replace new old :end2 keep)
                     (setf (frame-buffer-octets buffer) new)))))
             (keep (octets start end)
               ;; The start of a frame: copied, the octets are not ours after
               ;; the call; grown as octets come, never to the size a head declares.
               (let ((n (- end start)))
                 (when (or (>= (length (frame-buffer-octets buffer)) n)
                           (resize (max n 256) 0))
                   (replace (frame-buffer-octets buffer) octets :start2 start :end2 end)
                   (setf (frame-buffer-fill buffer) n)
                   t))))
      (lambda (octets &key (start 0) (end (length octets)))
        (declare (type octets octets) (type fixnum start end))
        (block read
          (when dead (return-from read))
          (let ((fill (frame-buffer-fill buffer)))
            (if (zerop fill)
                (multiple-value-bind (whole size close) (whole-frames-end octets start end)
                  (declare (ignore size))
                  (when close (funcall on-close-frame))
                  (when (< start whole)
                    (funcall callback octets :start start :end whole))
                  (when (and (< whole end) (not (keep octets whole end)))
                    (setf dead t)
                    (return-from read (funcall refused))))
                ;; A frame in parts: add to it, and go on once it is whole.
                (let ((total (+ fill (- end start))))
                  (when (and (> total (length (frame-buffer-octets buffer)))
                             ;; Doubled as octets come, but never past the
                             ;; frame being assembled (the buffer holds the
                             ;; start of one) or what came.
                             (not (resize (max total
                                               (min (* 2 (length (frame-buffer-octets buffer)))
                                                    (or (frame-size (frame-buffer-octets buffer) 0 fill)
                                                        total)))
                                          fill)))
                    (setf (frame-buffer-fill buffer) 0
                          dead t)
                    (return-from read (funcall refused)))
                  (let ((kept (frame-buffer-octets buffer)))
                    (declare (type octets kept))
                    (replace kept octets :start1 fill :start2 start :end2 end)
                    (setf (frame-buffer-fill buffer) total)
                    (multiple-value-bind (whole size close) (whole-frames-end kept 0 total)
                      (declare (ignore size))
                      (when close (funcall on-close-frame))
                      (when (plusp whole)
                        (funcall callback kept :start 0 :end whole)
                        (replace kept kept :start2 whole :end2 total)
                        (setf (frame-buffer-fill buffer) (- total whole))))))))
          (when (and (zerop (frame-buffer-fill buffer))
                     (> (length (frame-buffer-octets buffer)) 4096))
            ;; Nothing kept: no large buffer held by an idle socket.
            (resize 0 0)))))))

(defun asks-for-websocket-p (c)
  "True when the request on C asks for a WebSocket (Upgrade: websocket)."
  (let ((buffer (gallop.core:connection-head c)))
    (declare (type octets buffer))
    (gallop.core:do-request-fields (name-start name-end value-start value-end)
        (gallop.core:connection-request c)
      (when (and (= (- name-end name-start) 7)
                 (string-equal "upgrade" (latin1-string buffer name-start name-end))
                 (search "websocket" (string-downcase (latin1-string buffer value-start value-end))))
        (return-from asks-for-websocket-p t)))
    nil))

(defun take-socket (ex)
  "Switch EX's connection from HTTP to the app's own protocol, if not yet:
what the app writes from now on is sent as it is, and what the client sends
goes to the read callback.  Only while the app has not returned (or answered)."
  (let ((c (exchange-connection ex)))
    (unless (gallop.core:connection-upgraded-p c)
      (with-claim (claim ex)
        (unless (and (eq claim :direct) (not (exchange-responded ex)))
          (unclaim ex claim nil)
          (error "The connection of ~A can be taken as a socket only by the app, ~
                  before it returns or answers." ex))
        (unwind-protect
             (progn
               (gallop.core:connection-upgrade
                c
                :on-read (lambda (octets start end)
                           (let ((callback (exchange-read-callback ex)))
                             (when callback
                               (funcall callback octets :start start :end end))))
                :on-close (lambda ()
                            (let ((callback (exchange-close-callback ex)))
                              (when callback (funcall callback)))))
               (setf (exchange-responded ex) t
                     (exchange-keep-alive ex) t
                     (exchange-websocket ex) (asks-for-websocket-p c)))
          (unclaim ex claim nil))))
    c))

(defun socket-read-callback (socket)
  "The function called with what the client sends on SOCKET, as (CALLBACK
OCTETS :START START :END END), on a pool worker, one call at a time; the
octets are the server's once it returns."
  (exchange-read-callback socket))

(defun (setf socket-read-callback) (callback socket)
  (take-socket socket)
  (progn
    (setf (exchange-read-callback socket)
          (if (and callback (exchange-websocket socket))
              (frame-reader callback (lambda () (setf (exchange-websocket socket) :closing))
                            :charge (lambda (delta)
                                      (gallop.core:connection-charge-upgraded
                                       (exchange-connection socket) delta))
                            ;; The server's body budget is spent: it cannot
                            ;; hold this client's frame.
                            :refused (lambda () (socket-close socket :abort t)))
              callback))
    callback))

(defun socket-close-callback (socket)
  "The function called, with no argument, once SOCKET's connection ended
\(the client closed it or went away, a timeout, SOCKET-CLOSE, or the server
stopping), on a pool worker."
  (exchange-close-callback socket))

(defun (setf socket-close-callback) (callback socket)
  (take-socket socket)
  (setf (exchange-close-callback socket) callback))

(defun socket-write (socket data &key (start 0) end)
  "Send DATA (octets, or a string sent as UTF-8) on SOCKET from any thread,
after what was written before, without waiting for the client (DATA is
copied).  Returns the octets waiting for the client to take them
\(backpressure: see SOCKET-PENDING), or NIL when the connection is closed
or closing.  A backlog past the server's UPGRADED-SEND-LIMIT closes it."
  (let* ((c (take-socket socket))
         (octets (body-octets (if (and (stringp data) (or (plusp start) end))
                                  (subseq data start end) ; characters, not octets
                                  data)))
         (start (if (stringp data) 0 start))
         (end (if (stringp data) (length octets) (or end (length octets)))))
    (prog1 (gallop.core:connection-send-upgraded c octets :start start :end end)
      (when (and (eq (exchange-websocket socket) :closing) (< start end)
                 (= 8 (logand 15 (aref octets start))))
        ;; The answer to the client's close frame: the WebSocket is over,
        ;; and the server closes the TCP connection first (RFC 6455, 7.1.1),
        ;; once the client has it.  (websocket-driver leaves it open.)
        (gallop.core:connection-close-upgraded c)))))

(defun socket-pending (socket)
  "Octets written on SOCKET that the client has not taken yet."
  (gallop.core:connection-upgraded-pending (exchange-connection socket)))

(defun socket-close (socket &key abort)
  "Close SOCKET, from any thread: once the client has what was written
\(with ABORT, at once, dropping it).  The close callback is called."
  (gallop.core:connection-close-upgraded (take-socket socket) :abort abort)
  nil)
