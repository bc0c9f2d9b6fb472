;;;; websocket-frames.lisp -- the octets of a WebSocket (RFC 6455, 5): the
;;;; length a frame head declares, the frames a server sends, and what a
;;;; payload must be (UTF-8 text, close codes).
;;;;
;;;; One decoder reads a head's length, FRAME-LENGTH, for both readers of
;;;; frames: the socket's assembly of whole frames for a WebSocket library
;;;; (socket.lisp) and the native WebSocket's reader (websocket.lisp).  It
;;;; reads the length as sent; what the RFC refuses (the 64-bit form with its
;;;; high bit set) each reader decides on.  Nothing here touches a
;;;; connection: these are functions of octets.

(in-package #:gallop)

;;; Frame heads

(declaim (inline frame-mask-at))
(defun frame-mask-at (second)
  "Where the masking key begins in a frame head whose second octet is
SECOND: after the 7-bit length, or after the 16 or 64 bits that follow 126
or 127 there (RFC 6455, 5.2)."
  (case (logand second 127) (126 4) (127 10) (t 2)))

(declaim (inline frame-length))
(defun frame-length (octets start end)
  "The payload length declared by the head of the WebSocket frame at START
in OCTETS[START,END), and where its masking key begins (FRAME-MASK-AT: 2, 4
or 10 octets after START); NIL while the length is not all there.  A
length written in a longer form than it needs is read as any other, and
the 64-bit form's high bit is left to the caller."
  (declare (type octets octets) (type fixnum start end))
  (when (>= (- end start) 2)
    (let* ((second (aref octets (1+ start)))
           (at (frame-mask-at second)))
      (when (>= (- end start) at)
        (values (case at
                  (2 (logand second 127))
                  (4 (logior (ash (aref octets (+ start 2)) 8) (aref octets (+ start 3))))
                  (t (loop for i from 2 below 10
                           for n = (aref octets (+ start i))
                             then (logior (ash n 8) (aref octets (+ start i)))
                           finally (return n))))
                at)))))

(defun head-size (head)
  "The octets of the frame head begun in HEAD, once its first two are in."
  (+ (frame-mask-at (aref head 1))
     (if (logbitp 7 (aref head 1)) 4 0)))

;;; The frames a server sends

(defun frame-octets (opcode payload &optional (start 0) (end (length payload)) compressed)
  "A final, unmasked frame (as a server sends it) of OPCODE with
PAYLOAD[START,END); with RSV1 set when COMPRESSED."
  (declare (type octets payload) (type fixnum start end))
  (let* ((n (- end start))
         (head (cond ((< n 126) 2) ((< n 65536) 4) (t 10)))
         (frame (make-array (+ head n) :element-type '(unsigned-byte 8))))
    (setf (aref frame 0) (logior #x80 (if compressed #x40 0) opcode))
    (case head
      (2 (setf (aref frame 1) n))
      (4 (setf (aref frame 1) 126 (aref frame 2) (ldb (byte 8 8) n) (aref frame 3) (ldb (byte 8 0) n)))
      (t (setf (aref frame 1) 127)
       (dotimes (i 8) (setf (aref frame (+ 2 i)) (ldb (byte 8 (- 56 (* 8 i))) n)))))
    (replace frame payload :start1 head :start2 start :end2 end)
    frame))

(defun close-payload (code reason)
  "The payload of a close frame: CODE in two octets, then REASON in UTF-8,
cut to the 123 octets a control frame has room for, before a character
that would not fit whole (a peer closes on a reason that is not UTF-8)."
  (let* ((reason (sb-ext:string-to-octets reason :external-format :utf-8))
         (end (min (length reason) 123)))
    ;; A cut before a continuation octet (10xxxxxx) would split a character.
    (loop while (and (< end (length reason)) (= #b10 (ldb (byte 2 6) (aref reason end))))
          do (decf end))
    (concatenate 'octets (vector (ldb (byte 8 8) code) (ldb (byte 8 0) code))
                 (subseq reason 0 end))))

;;; What a client's payload must be

(defun valid-close-code-p (code)
  "A close code a peer may send (RFC 6455, 7.4; IANA's registry)."
  (or (<= 1000 code 1003) (<= 1007 code 1014) (<= 3000 code 4999)))

;;; UTF-8, checked as it arrives (RFC 3629): a state is the octets still
;;; needed by the character begun, and the range the next one must be in.

(declaim (inline utf8-state))
(defun utf8-state (need low high)
  (logior (ash need 16) (ash low 8) high))

(declaim (inline utf8-step))
(defun utf8-step (state octet)
  "The state after OCTET, from STATE (0: between characters); -1 when OCTET
makes the text invalid (a stray or missing continuation, an overlong form,
a surrogate, past U+10FFFF)."
  (declare (type fixnum state) (type (unsigned-byte 8) octet))
  (if (zerop state)
      (cond ((< octet #x80) 0)
            ((<= #xC2 octet #xDF) (utf8-state 1 #x80 #xBF))
            ((= octet #xE0) (utf8-state 2 #xA0 #xBF))
            ((or (<= #xE1 octet #xEC) (<= #xEE octet #xEF)) (utf8-state 2 #x80 #xBF))
            ((= octet #xED) (utf8-state 2 #x80 #x9F))
            ((= octet #xF0) (utf8-state 3 #x90 #xBF))
            ((<= #xF1 octet #xF3) (utf8-state 3 #x80 #xBF))
            ((= octet #xF4) (utf8-state 3 #x80 #x8F))
            (t -1))
      (let ((need (ldb (byte 2 16) state)) (low (ldb (byte 8 8) state)) (high (ldb (byte 8 0) state)))
        (if (<= low octet high)
            (if (= need 1) 0 (utf8-state (1- need) #x80 #xBF))
            -1))))

(defun utf8-valid-p (octets &optional (start 0) (end (length octets)))
  "True when OCTETS[START,END) is whole, valid UTF-8."
  (let ((state 0))
    (loop for i from start below end
          do (setf state (utf8-step state (aref octets i)))
             (when (minusp state) (return-from utf8-valid-p nil)))
    (zerop state)))
