;;;; ws-ends.lisp -- how a native WebSocket ends, and what it leaves behind.
;;;;
;;;; Each way a WebSocket can end in the middle of a message (1009 too big,
;;;; 1013 budget spent, 1002 and 1007 mid-message, the client hanging up,
;;;; the server's WS-CLOSE, the server stopping), a few rounds of a few
;;;; WebSockets each: every close on the wire byte by byte, the engine's
;;;; counts back to zero, the heap after a full collection back near where
;;;; it began, and a fresh WebSocket served exactly afterwards.  Then the
;;;; idle timeout and the server's pings: what a silent client reads, and
;;;; that one answering pings stays open.  The load version (50 WebSockets,
;;;; ten rounds) is in tests/stress/websockets.lisp.

(in-package #:gallop-tests)

(in-suite native)

(defparameter *fragment-payload*
  (make-array 65536 :element-type '(unsigned-byte 8) :initial-element 65)
  "What each fragment carries: 64 KiB of \"A\".")

(defparameter *text-begun* (ws-frame 1 *fragment-payload* :fin nil)
  "A text message's first frame, not final.")

(defparameter *continued* (ws-frame 0 *fragment-payload* :fin nil)
  "A continuation of it, not final.")

(defun send-fragments (socket n)
  "A text message begun on SOCKET in N frames of 64 KiB, none final."
  (ws-send socket *text-begun*)
  (loop repeat (1- n) do (ws-send socket *continued*)))

(defvar *ends-lock* (sb-thread:make-mutex :name "ws-ends"))
(defvar *ends-open* '() "The server's WebSockets opened, newest first.")
(defvar *ends-closes* '() "The codes ON-CLOSE saw, newest first.")

(defun ends-app (&key (max-message-bytes (* 4 1024 1024)) idle-timeout ping-interval)
  "An echo of WebSockets of at most MAX-MESSAGE-BYTES, with IDLE-TIMEOUT and
PING-INTERVAL; each one opened and each close noted."
  (lambda (env)
    (if (gallop:websocket-request-p env)
        (gallop:accept-websocket
         env :max-message-bytes max-message-bytes
             :idle-timeout idle-timeout :ping-interval ping-interval
             :on-open (lambda (ws)
                        (sb-thread:with-mutex (*ends-lock*) (push ws *ends-open*)))
             :on-message (lambda (ws message) (gallop:ws-send ws message))
             :on-close (lambda (ws code reason)
                         (declare (ignore ws reason))
                         (sb-thread:with-mutex (*ends-lock*) (push code *ends-closes*))))
        '(200 (:content-type "text/plain") ("plain")))))

(defun heap-octets ()
  "The heap in use after a full collection."
  (sb-ext:gc :full t)
  (sb-kernel:dynamic-usage))

(defun account-messages ()
  "The WebSocket messages in the memory account (src/core/account.lisp)."
  (memory-used :messages))

(defun engine-settled-p (engine)
  "True when ENGINE holds no WebSocket and no octet of a message."
  (and (zerop (getf (gallop.core:engine-stats engine) :body-bytes))
       (zerop (getf (gallop.core:engine-stats engine) :upgraded))
       (zerop (account-messages))))

(defun expect-close-then-eof (socket code reason what)
  "The server's close frame with CODE and REASON, exactly, then end of file."
  (expect-octets socket (server-frame 8 (ws-close-payload code reason)) what)
  (is (closed-by-peer-p socket) "~A: no end of file after the close" what))

(defun check-fresh-websocket (port)
  "A new WebSocket on PORT: a short text, a binary message past the size
whose copy counts in the body budget, and the close handshake, exactly."
  (with-native-socket (s port)
    (ws-send s (ws-frame 1 (octets "fresh")))
    (expect-octets s (server-frame 1 (octets "fresh")) "a fresh text")
    (let ((binary (make-array (* 100 1024) :element-type '(unsigned-byte 8))))
      (dotimes (i (length binary)) (setf (aref binary i) (mod (* 7 i) 256)))
      (ws-send s (ws-frame 2 binary))
      (expect-octets s (server-frame 2 binary) "a fresh 100 KiB"))
    (ws-send s (ws-frame 8 (ws-close-payload 1000)))
    (expect-close-then-eof s 1000 "" "a fresh close")))

(defparameter *ends-sockets* 4 "WebSockets a round.")
(defparameter *ends-rounds* 3)
(defparameter *ends-heap-slack* (* 16 1024 1024)
  "How far the heap after a full collection may end above where it began:
a round leaves up to 16 MiB of messages (4 WebSockets of 4 MiB) when they
are kept.")

(defun run-close-path (path port server)
  "One round of PATH on PORT: *ENDS-SOCKETS* WebSockets each begin a text
message in 64 KiB fragments, and it ends as PATH says, each client reading
exactly what the server sends."
  (sb-thread:with-mutex (*ends-lock*) (setf *ends-open* '()))
  (let ((sockets (loop repeat *ends-sockets* collect (native-ws port)))
        (held (* 2 1024 1024)))
    (unwind-protect
         (ecase path
           (:too-big
            ;; 4 MiB is the limit: one fragment more is refused at its head.
            (dolist (s sockets)
              (send-fragments s 65)
              (expect-close-then-eof s 1009 "message too big" "1009")))
           (:budget
            ;; Alone, each needs more than the 4 MiB budget.
            (dolist (s sockets)
              (send-fragments s 65)
              (expect-close-then-eof s 1013 "no memory for more messages now" "1013")))
           ((:protocol-error :bad-utf-8 :hangup :server-close :stop)
            ;; A ping after the fragments: its pong says all of them were read.
            (dolist (s sockets)
              (send-fragments s (/ held 65536))
              (ws-send s (ws-frame 9 (octets "read?")))
              (expect-octets s (server-frame 10 (octets "read?")) "the pong after the fragments"))
            (is (wait-until (lambda () (>= (getf (gallop.core:engine-stats
                                                 (gallop::server-engine server))
                                                :body-bytes)
                                          (* held *ends-sockets*))))
                "~A: the messages were never all held" path)
            (ecase path
              (:protocol-error
               (dolist (s sockets)
                 (ws-send s (ws-frame 1 (octets "a new one")))
                 (expect-close-then-eof s 1002 "a new message before the last one ended" "1002")))
              (:bad-utf-8
               (dolist (s sockets)
                 (ws-send s (ws-frame 0 #(#xFF) :fin nil))
                 (expect-close-then-eof s 1007 "invalid UTF-8 in a text message" "1007")))
              (:hangup
               (dolist (s sockets) (usocket:socket-close s)))
              (:server-close
               (is (wait-until (lambda () (= *ends-sockets* (length *ends-open*)))))
               (dolist (ws *ends-open*) (gallop:ws-close ws 4000 "mid-message"))
               (dolist (s sockets)
                 (expect-octets s (server-frame 8 (ws-close-payload 4000 "mid-message"))
                                "the server's close")
                 (ws-send s (ws-frame 8 (ws-close-payload 4000)))
                 (is (closed-by-peer-p s) "no end of file after the close handshake")))
              (:stop
               (gallop:stop server)
               (dolist (s sockets)
                 (is (closed-by-peer-p s) "the stop: no end of file, or octets before it"))))))
      (dolist (s sockets) (usocket:socket-close s))
      ;; Each refers to its server, and so to all it still holds.
      (sb-thread:with-mutex (*ends-lock*) (setf *ends-open* '())))))

(defmacro with-ends-server ((server app options) &body body)
  "Serve APP with GALLOP:START and OPTIONS (a plist, evaluated) on 127.0.0.1
and a free port, run BODY, and always stop it."
  `(let ((,server (apply #'gallop:start ,app :address "127.0.0.1" :port 0
                         :log (if (uiop:getenv "GALLOP_TEST_LOG") *error-output* nil)
                         ,options)))
     (unwind-protect (progn ,@body)
       (gallop:stop ,server))))

(defun check-close-path (path code &key server-options app-options)
  "Rounds of PATH against a server started with SERVER-OPTIONS, its app's
WebSockets accepted with APP-OPTIONS: ON-CLOSE sees CODE for each, nothing
is left counted after each round, the heap after a full collection ends
within *ENDS-HEAP-SLACK* of where it began, and a fresh WebSocket is served
exactly afterwards."
  (setf *ends-closes* '() *ends-open* '())
  (let ((app (apply #'ends-app app-options))
        (start (heap-octets)))
    (flet ((settled (engine)
             (is (wait-until (lambda () (engine-settled-p engine)))
                 "~A: still counted: ~D octets, ~D WebSockets, ~D in the account" path
                 (getf (gallop.core:engine-stats engine) :body-bytes)
                 (getf (gallop.core:engine-stats engine) :upgraded)
                 (account-messages)))
           (heap-checked ()
             (let ((grown (- (heap-octets) start)))
               (is (< grown *ends-heap-slack*) "~A: the heap grew by ~,1F MiB over ~D rounds"
                   path (/ grown 1048576.0) *ends-rounds*))))
      (if (eq path :stop)
          ;; A server a round, each stopped in the middle of the messages.
          (progn
            (dotimes (round *ends-rounds*)
              (with-ends-server (server app server-options)
                (let ((engine (gallop::server-engine server)))
                  (run-close-path path (native-port server) server)
                  (settled engine))))
            (heap-checked)
            (with-ends-server (server app server-options)
              (check-fresh-websocket (native-port server))))
          (with-ends-server (server app server-options)
            (dotimes (round *ends-rounds*)
              (run-close-path path (native-port server) server)
              (settled (gallop::server-engine server)))
            (heap-checked)
            (check-fresh-websocket (native-port server))
            (settled (gallop::server-engine server)))))
    (is (wait-until (lambda () (= (* *ends-rounds* *ends-sockets*) (count code *ends-closes*))))
        "~A: ON-CLOSE saw ~S" path *ends-closes*)))

(test websocket-refused-too-big-leaves-nothing
  "A message past :MAX-MESSAGE-BYTES, in 64 KiB fragments: 1009, and what
was assembled of it is let go at once."
  (check-close-path :too-big 1009))

(test websocket-refused-over-the-budget-leaves-nothing
  "Fragments past the :BODY-BUDGET: 1013, and the budget and the memory
are given back."
  (check-close-path :budget 1013 :server-options (list :body-budget (* 4 1024 1024))
                                 :app-options (list :max-message-bytes (* 16 1024 1024))))

(test websocket-protocol-error-mid-message-leaves-nothing
  "A new message while 2 MiB of one are held: 1002."
  (check-close-path :protocol-error 1002))

(test websocket-bad-utf-8-mid-message-leaves-nothing
  "Invalid UTF-8 in a fragment after 2 MiB of text: 1007."
  (check-close-path :bad-utf-8 1007))

(test websocket-hangup-mid-message-leaves-nothing
  "The client goes away with 2 MiB of a message held: 1006 to ON-CLOSE."
  (check-close-path :hangup 1006))

(test websocket-server-close-mid-message-leaves-nothing
  "WS-CLOSE while 2 MiB of a message are held: the server's close frame,
the client's answer, the end of the connection."
  (check-close-path :server-close 4000))

(test websocket-stop-mid-message-leaves-nothing
  "The server stops while each WebSocket holds 2 MiB of a message: each
client reads the end of the connection, and ON-CLOSE sees 1006."
  (check-close-path :stop 1006))

;;; Silent clients: the idle timeout, and the server's pings

(test websocket-silent-client-is-closed
  "A WebSocket whose client sends nothing for :UPGRADED-IDLE-TIMEOUT is
closed with no close frame: the client reads the end of the connection
and nothing before it; ON-CLOSE sees 1006."
  (setf *ends-closes* '())
  (with-ends-server (server (ends-app) (list :upgraded-idle-timeout 1))
    (with-native-socket (s (native-port server))
      (is (closed-by-peer-p s :timeout 10)))
    (is (wait-until (lambda () (equal '(1006) *ends-closes*))) "ON-CLOSE saw ~S" *ends-closes*)
    (is (wait-until (lambda () (engine-settled-p (gallop::server-engine server)))))
    (check-fresh-websocket (native-port server))))

(test websocket-pinged-client-that-answers-stays-open
  "With :PING-INTERVAL, a client silent for that long gets an empty ping,
exactly; answering each with a pong, it stays open past the interval and
the idle timeout together, and is then served."
  (with-ends-server (server (ends-app :ping-interval 0.5 :idle-timeout 1) '())
    (with-native-socket (s (native-port server))
      (dotimes (i 4)
        (expect-octets s (server-frame 9 #()) (format nil "ping ~D" (1+ i)))
        (ws-send s (ws-frame 10 #())))
      (ws-send s (ws-frame 1 (octets "still here")))
      (expect-octets s (server-frame 1 (octets "still here")) "the echo after the pings"))))

(test websocket-pinged-client-that-does-not-answer-is-closed
  "A client that leaves the ping unanswered gets that one ping, exactly,
then the end of the connection once the idle timeout passed after it."
  (setf *ends-closes* '())
  (with-ends-server (server (ends-app :ping-interval 0.5 :idle-timeout 1.5) '())
    (with-native-socket (s (native-port server))
      (expect-octets s (server-frame 9 #()) "the ping")
      (is (closed-by-peer-p s :timeout 10) "octets after the ping, or no end of file"))
    (is (wait-until (lambda () (equal '(1006) *ends-closes*))) "ON-CLOSE saw ~S" *ends-closes*)))
