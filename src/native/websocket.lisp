;;;; websocket.lisp -- WebSockets for native apps (RFC 6455), on the socket
;;;; an app takes when it switches protocols (socket.lisp):
;;;;
;;;;   (lambda (env)
;;;;     (if (gallop:websocket-request-p env)
;;;;         (gallop:accept-websocket env :on-message (lambda (ws message)
;;;;                                                     (gallop:ws-send ws message)))
;;;;         '(200 (:content-type "text/plain") ("not a WebSocket"))))
;;;;
;;;; ACCEPT-WEBSOCKET checks the handshake (400, or 426 for another version),
;;;; answers 101 and returns what the app returns.  Between messages the
;;;; connection waits in epoll with no thread; a message arrives whole on a
;;;; pool worker (ON-MESSAGE: a string for text, octets for binary), in order,
;;;; one at a time.  WS-SEND, WS-PING and WS-CLOSE work from any thread and
;;;; never wait for the client; WS-SEND answers the octets still waiting for
;;;; it (backpressure), NIL once the WebSocket is closing.
;;;;
;;;; The reader is a state machine over whatever octets arrive: a frame split
;;;; anywhere, one octet at a time or many frames in one read, reads the same.
;;;; It checks what RFC 6455 makes the server check: masking, reserved bits
;;;; and opcodes, control frames (final, at most 125 octets, allowed between
;;;; the fragments of a message), continuation order, close codes (1002),
;;;; UTF-8 of text messages and close reasons as they arrive (1007), and the
;;;; message size (1009).
;;;;
;;;; One extension is negotiated when the app asks for it (:DEFLATE):
;;;; permessage-deflate (RFC 7692), each message compressed on its own, so
;;;; that a WebSocket keeps no compression state between messages
;;;; (zlib.lisp; doc/design.md, "WebSocket compression").
;;;;
;;;; The handshake's checks and answer are in websocket-handshake.lisp; the
;;;; frames' octets (the length a head declares, the frames sent, UTF-8,
;;;; close codes) in websocket-frames.lisp.  Here: the WebSocket itself, its
;;;; reader, its sends and its close.

(in-package #:gallop)

;;; The WebSocket

(defstruct (websocket (:constructor %make-websocket) (:conc-name ws-) (:copier nil)
                      (:predicate websocket-p))
  "A WebSocket a native app accepted (ACCEPT-WEBSOCKET)."
  (socket nil)                          ; its exchange, taken as a socket
  (env nil)
  (protocol nil)                        ; the subprotocol chosen, or NIL
  (user-data nil)
  (on-open nil) (on-message nil) (on-close nil) (on-pong nil)
  (max-message 0 :type fixnum)
  (deflate nil)                         ; the window bits to compress with, when agreed
  (deflate-min 0 :type fixnum)          ; shorter messages are sent as they are
  (ping-interval nil)                   ; seconds of the client's silence before a ping
  (pinged nil)                          ; the client's silence the last ping was sent in
  ;; the reader (READ-FRAMES), touched by one worker at a time
  (head (make-array 14 :element-type '(unsigned-byte 8)) :type octets)
  (head-fill 0 :type fixnum)
  (in-payload nil)
  (fin nil) (opcode 0 :type fixnum)
  (mask (make-array 4 :element-type '(unsigned-byte 8)) :type octets)
  (mask-at 0 :type fixnum)
  (left 0 :type integer)
  (message (make-array 0 :element-type '(unsigned-byte 8)) :type octets)
  (message-fill 0 :type fixnum)
  (message-opcode nil)                  ; 1 or 2 while a message is in fragments
  (compressed nil)                      ; the message in progress is compressed
  (utf8 0 :type fixnum)
  (control (make-array 125 :element-type '(unsigned-byte 8)) :type octets)
  (control-fill 0 :type fixnum)
  (failed nil)                          ; nothing more is read
  ;; closing
  (close-sent nil)
  (close-code 1006 :type fixnum)
  (close-reason "" :type string)
  (closed nil))

(defmethod print-object ((ws websocket) stream)
  (print-unreadable-object (ws stream :type t :identity t)))

(defun accept-websocket (env &key on-open on-message on-close on-pong protocols
                                  (max-message-bytes (* 16 1024 1024)) idle-timeout
                                  ping-interval deflate (deflate-min-bytes 256))
  "Answer the WebSocket handshake of ENV: what the app returns.  A handshake
this server refuses gets 400 (426 for another version than 13); else 101,
and from then on ON-OPEN (WS) once, ON-MESSAGE (WS MESSAGE) for each
message (a string for text, octets for binary), ON-PONG (WS OCTETS), and
ON-CLOSE (WS CODE REASON) once when it ends (CODE 1006 when no close frame
came), each on a pool worker.  PROTOCOLS: the subprotocols served, the
first the client lists among them is chosen (WS-PROTOCOL).  A message over
MAX-MESSAGE-BYTES closes with 1009.  IDLE-TIMEOUT (seconds): closed, with
no close frame, when the client sends nothing for that long (default: the
server's UPGRADED-IDLE-TIMEOUT, 60 s).  PING-INTERVAL (seconds, or NIL for
none): a ping once the client was silent for that long, one per silence;
the client then has IDLE-TIMEOUT to answer (a pong, or anything), so that
a live client that has nothing to say stays open.  DEFLATE: agree to
permessage-deflate when the client offers it, each message compressed on
its own; messages sent shorter than DEFLATE-MIN-BYTES, or that would not
shrink, go uncompressed.  MAX-MESSAGE-BYTES bounds a message inflated."
  (let ((refusal (websocket-refusal env)))
    (when refusal
      (return-from accept-websocket refusal)))
  (let* ((socket (env-socket env))
         (offered (let ((value (env-header env "sec-websocket-protocol")))
                    (and value (comma-list value))))
         (protocol (find-if (lambda (p) (member p protocols :test #'string=)) offered))
         (extensions (env-header env "sec-websocket-extensions")))
    (multiple-value-bind (extension window)
        (and deflate extensions (zlib-available-p) (deflate-agreement extensions))
      (accept-switched env socket protocol extension
                       (%make-websocket :socket socket :env env :protocol protocol
                                        :on-open on-open :on-message on-message
                                        :on-close on-close :on-pong on-pong
                                        :max-message max-message-bytes
                                        :ping-interval ping-interval
                                        :deflate window :deflate-min deflate-min-bytes)
                       idle-timeout))))

(defun accept-switched (env socket protocol extension ws idle-timeout)
  "Take SOCKET for WS and answer 101 with PROTOCOL and EXTENSION."
  (let* ((c (take-socket socket))
         (timeout (or idle-timeout (gallop.core:connection-upgraded-idle-timeout c)))
         (interval (ws-ping-interval ws)))
    (when (or idle-timeout (and interval timeout))
      ;; With pings, the client's silence may last the interval, then the
      ;; timeout for its answer.
      (gallop.core:connection-set-upgraded-idle-timeout c (and timeout (+ timeout (or interval 0)))))
    (when interval
      (ping-later ws interval))
    ;; Too far behind: 1008 (WS-FALL-BEHIND).  Shed by the overload
    ;; manager: 1013, try again later (RFC 6455, 7.4.1).
    (gallop.core:connection-set-upgraded-on-limit c (lambda () (ws-fall-behind ws)))
    (gallop.core:connection-set-upgraded-on-shed c (lambda () (ws-shed ws)))
    (setf (exchange-read-callback socket)
          (lambda (octets &key start end) (read-frames ws octets start end))
          (exchange-close-callback socket)
          (lambda () (websocket-ended ws)))
    (socket-write socket (switching-protocols (websocket-accept (env-header env "sec-websocket-key"))
                                              protocol extension))
    (when (ws-on-open ws)
      (ws-call ws (ws-on-open ws) ws))
    (lambda (responder) (declare (ignore responder)))))

(defun ws-call (ws function &rest args)
  "Call one of WS's callbacks; an error in it is logged and closes WS with 1011."
  (handler-case (apply function args)
    (serious-condition (e)
      (let ((server (exchange-server (ws-socket ws))))
        (log-error server "Error in a WebSocket callback: ~A" e))
      (ws-fail ws 1011 "internal error"))))

;;; Sending, from any thread

(defun send-frame (ws opcode payload &optional (start 0) (end (length payload)) compressed)
  (let ((frame (frame-octets opcode payload start end compressed)))
    (gallop.core:connection-send-upgraded (exchange-connection (ws-socket ws)) frame
                                          :copy nil)))

(defun ws-send (ws data &key binary)
  "Send DATA on WS, from any thread, without waiting for the client: a string
as a text message (UTF-8; with BINARY, as a binary one), octets as a binary
message.  Returns the octets waiting for the client to take them, or NIL
when WS is closing or closed.  A send that finds more waiting than the
server's UPGRADED-SEND-LIMIT closes WS with 1008 instead (WS-FALL-BEHIND)."
  (unless (ws-close-sent ws)
    (let ((opcode (if (and (stringp data) (not binary)) 1 2))
          (octets (body-octets data)))
      (multiple-value-bind (deflated length)
          (and (ws-deflate ws) (>= (length octets) (ws-deflate-min ws))
               (deflate-message octets (ws-deflate ws)))
        (if deflated
            (send-frame ws opcode deflated 0 length t)
            (send-frame ws opcode octets))))))

(defun ws-broadcast (websockets data &key binary)
  "Send DATA to each WebSocket of the sequence WEBSOCKETS as WS-SEND would,
from any thread, without waiting for any client, with its frame made once:
every recipient's queue holds a reference to the same octets, which are in
memory, and counted in the memory account, once.  With permessage-deflate,
DATA is compressed once for each window size the recipients agreed to (it
goes uncompressed to those it is too short for, as with WS-SEND).  Each
recipient's backlog (WS-PENDING) counts the frame in full, and one whose
backlog is past the send limit is closed with 1008 as with WS-SEND.
Returns how many WebSockets it was queued for: closing ones, and those
closed for lagging, are not counted."
  (let* ((opcode (if (and (stringp data) (not binary)) 1 2))
         (octets (body-octets data))
         (frames '()))                  ; (window . shared-octets), window NIL: plain
    (labels ((make (window)
               (multiple-value-bind (deflated length)
                   (and window (deflate-message octets window))
                 (if deflated
                     (gallop.core:make-shared-octets (frame-octets opcode deflated 0 length t))
                     (or (cdr (assoc nil frames))
                         (let ((plain (gallop.core:make-shared-octets (frame-octets opcode octets))))
                           (push (cons nil plain) frames)
                           plain)))))
             (frame (window)
               (or (cdr (assoc window frames))
                   (let ((shared (make window)))
                     (pushnew (cons window shared) frames :key #'car)
                     shared))))
      (let ((count 0))
        (unwind-protect
             (map nil (lambda (ws)
                        (unless (ws-close-sent ws)
                          (let ((window (and (ws-deflate ws) (>= (length octets) (ws-deflate-min ws))
                                             (ws-deflate ws))))
                            (when (gallop.core:connection-send-shared (ws-connection ws)
                                                                      (frame window))
                              (incf count)))))
                  websockets)
          ;; The queues hold the frames now; the maker lets go.
          (loop for shared in (remove-duplicates (mapcar #'cdr frames))
                do (gallop.core:release-shared-octets shared)))
        count))))

(defun ws-ping (ws &optional (data #.(make-array 0 :element-type '(unsigned-byte 8))))
  "Send a ping (at most 125 octets of DATA) on WS; the pong comes to ON-PONG."
  (let ((octets (body-octets data)))
    (assert (<= (length octets) 125) () "A ping carries at most 125 octets.")
    (unless (ws-close-sent ws)
      (send-frame ws 9 octets))))

(defun ping-later (ws seconds)
  "Look at WS's client's silence again in SECONDS (PING-WHEN-SILENT), unless
its server stopped."
  (let ((engine (gallop.core:connection-engine (ws-connection ws))))
    (when (gallop.core:engine-running-p engine)
      (handler-case (gallop.core:schedule-timer (gallop.core:engine-pool engine) seconds
                                                (lambda () (ping-when-silent ws)))
        ;; Stopped meanwhile: its timers are dropped.
        (error () nil)))))

(defun ping-when-silent (ws)
  "WS's ping timer: once its client was silent for the ping interval, a
ping, unless one was sent in this silence already; then the next look."
  (unless (or (ws-closed ws) (ws-close-sent ws))
    (let ((interval (ws-ping-interval ws)))
      (multiple-value-bind (silent silence) (gallop.core:connection-upgraded-silence
                                             (ws-connection ws))
        (cond ((< silent interval)
               (ping-later ws (- interval silent)))
              ((eql silence (ws-pinged ws))
               ;; No answer yet: the idle timeout closes it.
               (ping-later ws interval))
              ((ws-ping ws)
               (setf (ws-pinged ws) silence)
               (ping-later ws interval)))))))

(defun ws-pending (ws)
  "Octets sent on WS that the client has not taken yet."
  (socket-pending (ws-socket ws)))

(defconstant +close-wait-seconds+ 5
  "How long a WebSocket whose server sent its close frame waits for the
client's before the connection is closed anyway.")

(defun ws-close (ws &optional (code 1000) (reason ""))
  "Begin the close handshake of WS, from any thread: send a close frame with
CODE and REASON (cut to fit); the connection closes once the client answers
\(or +CLOSE-WAIT-SECONDS+ later).  Nothing is sent after it."
  (when (null (sb-ext:compare-and-swap (ws-close-sent ws) nil t))
    (setf (ws-close-code ws) code (ws-close-reason ws) reason)
    (send-frame ws 8 (close-payload code reason))
    (abort-later ws))
  nil)

(defun abort-later (ws)
  "Abort WS's connection +CLOSE-WAIT-SECONDS+ from now, unless it ended."
  (let* ((c (exchange-connection (ws-socket ws)))
         (pool (gallop.core:engine-pool (gallop.core:connection-engine c))))
    (when pool
      (gallop.core:schedule-timer pool +close-wait-seconds+
                                  (lambda () (socket-close (ws-socket ws) :abort t))))))

(defun ws-cut (ws code reason)
  "Close WS with CODE and REASON without waiting for its client, from any
thread: nothing more is read, what waits for the client and has not begun
to go out is dropped, the close frame follows the message the socket is
taking, and the connection closes once the client has it, or is aborted
+CLOSE-WAIT-SECONDS+ later (a client that reads nothing would never get
it).  ON-CLOSE gets CODE.  When WS was closing already, it is aborted at
once."
  (setf (ws-failed ws) t)
  (if (null (sb-ext:compare-and-swap (ws-close-sent ws) nil t))
      (progn
        (setf (ws-close-code ws) code (ws-close-reason ws) reason)
        (gallop.core:connection-cut-upgraded (ws-connection ws)
                                             (frame-octets 8 (close-payload code reason)))
        (abort-later ws))
      (socket-close (ws-socket ws) :abort t)))

(defun ws-fall-behind (ws)
  "A send found more waiting for WS's client than the server's
UPGRADED-SEND-LIMIT (or, short of memory, more than a little): the client
does not keep up.  WS is cut (WS-CUT) with 1008, policy violation (a server
short of memory closes with 1013, try again later: WS-SHED)."
  (ws-cut ws 1008 "too far behind"))

(defun drop-message (ws)
  "WS reads no more messages: let go of the one it was assembling, and of
its count in the body budget."
  (let ((held (length (ws-message ws))))
    (setf (ws-message ws) (make-array 0 :element-type '(unsigned-byte 8))
          (ws-message-fill ws) 0
          (ws-message-opcode ws) nil)
    (unless (zerop held)
      (charge ws (- held)))))

(defun ws-fail (ws code reason)
  "The client broke the protocol (or a callback failed, or no memory is left
for its message): close WS with CODE, read nothing more."
  (setf (ws-failed ws) t)
  (drop-message ws)
  (when (null (sb-ext:compare-and-swap (ws-close-sent ws) nil t))
    (setf (ws-close-code ws) code (ws-close-reason ws) reason)
    (send-frame ws 8 (close-payload code reason)))
  (socket-close (ws-socket ws)))

(defun ws-shed (ws)
  "The server is short of memory and WS holds among the most (the overload
manager, from its own thread): WS is cut (WS-CUT) with 1013, try again
later.  The message it was assembling goes when it ends."
  (ws-cut ws 1013 "server short of memory"))

(defun websocket-ended (ws)
  "The connection of WS ended (the socket's close callback): ON-CLOSE, once."
  (unless (shiftf (ws-closed ws) t)
    ;; The app may keep WS: it keeps no message.
    (drop-message ws)
    (when (ws-on-close ws)
      (ws-call ws (ws-on-close ws) ws (ws-close-code ws) (ws-close-reason ws)))))

;;; Reading

(defun read-frames (ws octets start end)
  "Read OCTETS[START,END), what the client sent next, into WS's frames."
  (declare (type octets octets) (type fixnum start end))
  (loop while (and (< start end) (not (ws-failed ws)))
        do (if (ws-in-payload ws)
               (setf start (read-payload ws octets start end))
               (setf start (read-head ws octets start end)))))

(defun read-head (ws octets start end)
  "Take the octets of a frame head from OCTETS[START,END); once it is whole,
check it.  The index after what was taken."
  (let ((head (ws-head ws)))
    (loop while (and (< start end)
                     (< (ws-head-fill ws) (if (< (ws-head-fill ws) 2) 2 (head-size head))))
          do (setf (aref head (ws-head-fill ws)) (aref octets start))
             (incf (ws-head-fill ws))
             (incf start))
    (when (and (>= (ws-head-fill ws) 2) (= (ws-head-fill ws) (head-size head)))
      (setf (ws-head-fill ws) 0)
      (begin-frame ws head))
    start))

(defun begin-frame (ws head)
  "Check a whole frame head and get ready for its payload."
  (let* ((first (aref head 0))
         (second (aref head 1))
         (fin (logbitp 7 first))
         (opcode (logand first 15))
         (control (>= opcode 8))
         (short (logand second 127)))
    (multiple-value-bind (length mask-at) (frame-length head 0 (length head))
      (cond ((or (plusp (logand first #x30))
                 ;; RSV1: a compressed message, in its first frame (RFC 7692, 6)
                 (and (logbitp 6 first) (not (and (ws-deflate ws) (member opcode '(1 2))))))
             (ws-fail ws 1002 "reserved bits set"))
            ((not (member opcode '(0 1 2 8 9 10))) (ws-fail ws 1002 "unknown opcode"))
            ((not (logbitp 7 second)) (ws-fail ws 1002 "a client's frame must be masked"))
            ((and control (not fin)) (ws-fail ws 1002 "a fragmented control frame"))
            ((and control (> length 125)) (ws-fail ws 1002 "a control frame over 125 octets"))
            ((and (= short 127) (logbitp 63 length)) (ws-fail ws 1002 "a length over 2^63"))
            ((and (= opcode 0) (null (ws-message-opcode ws)))
             (ws-fail ws 1002 "a continuation with no message begun"))
            ((and (member opcode '(1 2)) (ws-message-opcode ws))
             (ws-fail ws 1002 "a new message before the last one ended"))
            ((and (not control)
                  (> (+ (if (= opcode 0) (ws-message-fill ws) 0) length) (ws-max-message ws)))
             (ws-fail ws 1009 "message too big"))
            (t
             (replace (ws-mask ws) head :start2 mask-at :end2 (+ mask-at 4))
             (setf (ws-fin ws) fin
                   (ws-opcode ws) opcode
                   (ws-mask-at ws) 0
                   (ws-left ws) length
                   (ws-control-fill ws) 0)
             (unless control
               (when (member opcode '(1 2))
                 (setf (ws-message-opcode ws) opcode
                       (ws-compressed ws) (logbitp 6 first)
                       (ws-message-fill ws) 0
                       (ws-utf8 ws) 0)))
             (if (zerop length)
                 (end-frame ws)
                 (setf (ws-in-payload ws) t)))))))

(defun ws-connection (ws) (exchange-connection (ws-socket ws)))

(defun reserve-message (ws more &optional (fill (ws-message-fill ws)))
  "Room in WS's message buffer, holding FILL octets, for MORE octets, come:
it grows with what arrives (doubling, up to the size limit), never to what
a frame head declares, so that a client holds only the memory it sent; and
it counts in the server's body budget.  NIL, WS closed with 1013 (try again
later), when the budget is spent."
  (let ((need (+ fill more))
        (buffer (ws-message ws)))
    (if (<= need (length buffer))
        t
        (let ((size (max need (min (* 2 (length buffer)) (ws-max-message ws)))))
          (if (not (charge ws (- size (length buffer))))
              (progn (ws-fail ws 1013 "no memory for more messages now") nil)
              (let ((bigger (make-array size :element-type '(unsigned-byte 8))))
                (replace bigger buffer :end2 fill)
                (setf (ws-message ws) bigger)
                t))))))

(defun read-payload (ws octets start end)
  "Unmask what OCTETS[START,END) holds of the current frame's payload into
its message (or control) buffer.  The index after it."
  (declare (type octets octets) (type fixnum start end))
  (let* ((n (min (- end start) (ws-left ws)))
         (control (>= (ws-opcode ws) 8))
         (buffer (cond (control (ws-control ws))
                       ((reserve-message ws n) (ws-message ws))
                       (t (return-from read-payload end))))
         (at (if control (ws-control-fill ws) (ws-message-fill ws)))
         (mask (ws-mask ws))
         (k (ws-mask-at ws))
         (text (and (not control) (eql (ws-message-opcode ws) 1) (not (ws-compressed ws))))
         (state (ws-utf8 ws)))
    (declare (type fixnum n at k state) (type octets buffer mask))
    (dotimes (i n)
      (let ((octet (logxor (aref octets (+ start i)) (aref mask (logand (+ k i) 3)))))
        (setf (aref buffer (+ at i)) octet)
        (when text
          (setf state (utf8-step state octet))
          (when (minusp state)
            (ws-fail ws 1007 "invalid UTF-8 in a text message")
            (return-from read-payload end)))))
    (setf (ws-mask-at ws) (logand (+ k n) 3)
          (ws-utf8 ws) state)
    (if control (incf (ws-control-fill ws) n) (incf (ws-message-fill ws) n))
    (decf (ws-left ws) n)
    (when (zerop (ws-left ws))
      (setf (ws-in-payload ws) nil)
      (end-frame ws))
    (+ start n)))

(defun end-frame (ws)
  "A frame's payload is all read: act on it."
  (case (ws-opcode ws)
    ((0 1 2)
     (when (ws-fin ws)
       (let ((opcode (shiftf (ws-message-opcode ws) nil))
             (fill (shiftf (ws-message-fill ws) 0)))
         (cond ((and (= opcode 1) (not (zerop (ws-utf8 ws))))
                (ws-fail ws 1007 "a text message ends inside a character"))
               ((ws-close-sent ws))     ; closing: data is not delivered
               ((ws-compressed ws) (deliver-inflated ws opcode fill))
               (t (deliver ws opcode (ws-message ws) fill))))))
    (9 (unless (ws-close-sent ws)
         (send-frame ws 10 (subseq (ws-control ws) 0 (ws-control-fill ws)))))
    (10 (when (ws-on-pong ws)
          (ws-call ws (ws-on-pong ws) ws (subseq (ws-control ws) 0 (ws-control-fill ws)))))
    (8 (read-close ws (subseq (ws-control ws) 0 (ws-control-fill ws))))))

(defun charge (ws delta &optional (kind :messages))
  "Count DELTA more octets of WS's messages in the server's body budget and
the memory account (KIND :MESSAGES, or :INFLATE for what inflating one
made): true when they fit (always, for a WebSocket with no socket: a
test's)."
  (or (null (ws-socket ws))
      (gallop.core:connection-charge-upgraded (ws-connection ws) delta kind)))

(defconstant +small-message-octets+ 65536
  "A message buffer this large or smaller is kept between messages, and a
copy handed to ON-MESSAGE this large or smaller is not counted in the body
budget: each worker delivers one message at a time, so the copies not
counted are bounded by the workers, and the budget's atomic counters stay
off the path of ordinary messages.")

(defun deliver (ws opcode octets end)
  "Give the message OCTETS[0,END) to ON-MESSAGE: text (OPCODE 1) as a
string.  A copy handed over larger than +SMALL-MESSAGE-OCTETS+ counts in
the body budget until ON-MESSAGE returns (a string takes 4 octets a
character): past the budget, 1013."
  (let* ((size (if (= opcode 1) (* 4 end) end))
         (copy (if (> size +small-message-octets+) size 0)))
    (if (not (or (zerop copy) (charge ws copy)))
        (ws-fail ws 1013 "no memory for more messages now")
        (unwind-protect
             (let ((message (if (= opcode 1)
                                (sb-ext:octets-to-string octets :external-format :utf-8 :end end)
                                (subseq octets 0 end))))
               (when (> (length (ws-message ws)) +small-message-octets+)
                 ;; No large buffer kept between messages.
                 (charge ws (- (length (ws-message ws))))
                 (setf (ws-message ws) (make-array 0 :element-type '(unsigned-byte 8))))
               (when (ws-on-message ws)
                 (ws-call ws (ws-on-message ws) ws message)))
          (unless (zerop copy)
            (charge ws (- copy)))))))

(defun deliver-inflated (ws opcode fill)
  "Inflate the compressed message in WS's first FILL octets (RFC 7692,
7.2.2) and deliver it: data that does not inflate, or text that is not
UTF-8, closes with 1007; more than the message limit with 1009.  The
inflated octets count in the body budget while they are held (1013)."
  (when (reserve-message ws 4 fill)
    (let ((buffer (ws-message ws))
          (charged 0))
      (replace buffer #(0 0 #xFF #xFF) :start1 fill)
      (unwind-protect
           (multiple-value-bind (out length)
               (inflate-message buffer (+ fill 4) (ws-max-message ws)
                                (lambda (delta)
                                  (and (charge ws delta :inflate) (incf charged delta))))
             (case out
               (:invalid (ws-fail ws 1007 "invalid compressed data"))
               (:too-big (ws-fail ws 1009 "message too big"))
               (:no-memory (ws-fail ws 1013 "no memory for more messages now"))
               (t (if (and (= opcode 1) (not (utf8-valid-p out 0 length)))
                      (ws-fail ws 1007 "invalid UTF-8 in a text message")
                      (deliver ws opcode out length)))))
        (charge ws (- charged) :inflate)))))

(defun read-close (ws payload)
  "The client's close frame: check it, answer it (unless the server began
the close), then close the connection (the server closes TCP first, RFC
6455, 7.1.1)."
  (let* ((n (length payload))
         (code (and (>= n 2) (logior (ash (aref payload 0) 8) (aref payload 1)))))
    (cond ((= n 1) (ws-fail ws 1002 "a close frame of one octet"))
          ((and code (not (valid-close-code-p code))) (ws-fail ws 1002 "an invalid close code"))
          ((and code (not (utf8-valid-p payload 2))) (ws-fail ws 1007 "invalid UTF-8 in a close reason"))
          (t
           (setf (ws-failed ws) t)      ; nothing is read after a close frame
           (when (null (sb-ext:compare-and-swap (ws-close-sent ws) nil t))
             (setf (ws-close-code ws) (or code 1005)
                   (ws-close-reason ws) (if code
                                            (sb-ext:octets-to-string payload :external-format :utf-8
                                                                             :start 2)
                                            ""))
             ;; The same code back (none when none came).
             (send-frame ws 8 (if code (subseq payload 0 2) payload)))
           (socket-close (ws-socket ws))))))
