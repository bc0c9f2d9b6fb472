;;;; websocket.lisp -- the native WebSocket API (src/native/websocket.lisp):
;;;; SHA-1, base64 and UTF-8 on octet vectors; then a real server and socket,
;;;; every answer checked byte by byte, each exchange sent whole and one
;;;; octet at a time: handshakes and refusals, messages at each length
;;;; form, fragments with control frames between them, the close handshake
;;;; and every protocol error the server must close on, with its code.

(in-package #:gallop-tests)

(in-suite native)

(deftype octets-vector () '(simple-array (unsigned-byte 8) (*)))

(defun hex (octets) (format nil "~(~{~2,'0x~}~)" (coerce octets 'list)))

(test sha1-and-base64
  (is (string= "da39a3ee5e6b4b0d3255bfef95601890afd80709" (hex (gallop::sha1 (octets "")))))
  (is (string= "a9993e364706816aba3e25717850c26c9cd0d89d" (hex (gallop::sha1 (octets "abc")))))
  (is (string= "84983e441c3bd26ebaae4aa1f95129e5e54670f1"
               (hex (gallop::sha1 (octets "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")))))
  (is (string= "34aa973cd4c4daa4f61eeb2bdbad27316534016f"
               (hex (gallop::sha1 (make-array 1000000 :element-type '(unsigned-byte 8)
                                                       :initial-element 97)))))
  (is (equal '("" "Zg==" "Zm8=" "Zm9v" "Zm9vYg==" "Zm9vYmE=" "Zm9vYmFy")
             (mapcar (lambda (s) (gallop::base64-encode (octets s)))
                     '("" "f" "fo" "foo" "foob" "fooba" "foobar"))))
  (is (string= "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" (gallop::websocket-accept "dGhlIHNhbXBsZSBub25jZQ==")))
  (is (gallop::websocket-key-p "dGhlIHNhbXBsZSBub25jZQ=="))
  (dolist (bad '("dGhlIHNhbXBsZSBub25jZQ=" "dGhlIHNhbXBsZSBub25jZR==" "dGhlIHNhbXBsZSBub25j*Q=="
                 "" nil "dGhlIHNhbXBsZSBub25jZQ==="))
    (is (not (gallop::websocket-key-p bad)) "~S" bad)))

(test utf8-checked-as-it-arrives
  (dolist (good (list #() #(#x41) #(#xC2 #x80) #(#xDF #xBF) #(#xE0 #xA0 #x80) #(#xED #x9F #xBF)
                      #(#xEE #x80 #x80) #(#xF0 #x90 #x80 #x80) #(#xF4 #x8F #xBF #xBF)
                      (sb-ext:string-to-octets "κόσμε" :external-format :utf-8)))
    (is (gallop::utf8-valid-p (coerce good 'octets-vector)) "~S" good))
  (dolist (bad (list #(#x80) #(#xC0 #x80) #(#xC1 #xBF) #(#xE0 #x9F #xBF) #(#xED #xA0 #x80)
                     #(#xF0 #x8F #xBF #xBF) #(#xF4 #x90 #x80 #x80) #(#xF5 #x80 #x80 #x80)
                     #(#xFF) #(#xC2) #(#xE1 #x80) #(#x41 #xC2 #x41)))
    (is (not (gallop::utf8-valid-p (coerce bad 'octets-vector))) "~S" bad)))

;;; A live server

(defvar *ws-closes* nil "(CODE REASON) of each ON-CLOSE, newest first.")
(defvar *ws-last* nil "The WebSocket accepted last.")

(defun native-ws-app (env)
  "/echo echoes; \"close-me\" makes the server close (4001); \"pings\" sends a
ping.  Messages over 1,000,000 octets close with 1009."
  (cond ((gallop:websocket-request-p env)
         (gallop:accept-websocket
          env :protocols '("chat")
              :max-message-bytes (* 17 1024 1024)
              :deflate t :deflate-min-bytes 64
              :on-open (lambda (ws) (setf *ws-last* ws))
              :on-message (lambda (ws message)
                            (cond ((equal message "close-me") (gallop:ws-close ws 4001 "asked"))
                                  ((equal message "pings") (gallop:ws-ping ws "hey"))
                                  (t (gallop:ws-send ws message))))
              :on-close (lambda (ws code reason)
                          (declare (ignore ws))
                          (push (list code reason) *ws-closes*))))
        (t '(200 (:content-type "text/plain") ("plain")))))

(defvar *ws-server* nil "The server WITH-NATIVE-WS-OPTIONS runs.")

(defmacro with-native-ws-options ((port &rest options) &body body)
  `(progn (setf *ws-closes* nil *ws-last* nil)
          (with-app (server #'native-ws-app ,@options)
            (let ((*ws-server* server)
                  (,port (native-port server)))
              ,@body))))

(defmacro with-native-ws ((port) &body body)
  `(with-native-ws-options (,port) ,@body))

(defun expect-close-code (socket code)
  "The next frame from SOCKET is a close frame with CODE; then end of file."
  (let* ((head (read-octets socket 2))
         (length (and (= 2 (length head)) (logand (aref head 1) 127)))
         (payload (and length (read-octets socket length))))
    (is (and length (= #x88 (aref head 0))) "not a close frame: ~S" head)
    (is (and payload (>= (length payload) 2)
             (= code (logior (ash (aref payload 0) 8) (aref payload 1))))
        "close code ~S, not ~D" payload code)
    (is (closed-by-peer-p socket))))

(defun exact-101 (&optional protocol)
  (octets (apply #'crlf "HTTP/1.1 101 Switching Protocols" "Upgrade: websocket"
                 "Connection: Upgrade" (format nil "Sec-WebSocket-Accept: ~A" *rfc-accept*)
                 (and protocol (list (format nil "Sec-WebSocket-Protocol: ~A" protocol))))))

(defun native-ws (port &key one-by-one (extra '()))
  "A connection to PORT's /echo with the handshake answered exactly."
  (let ((socket (connect port)))
    (ws-send socket (octets (apply #'ws-handshake "/echo" extra)) :one-by-one one-by-one)
    (expect-octets socket (exact-101 (and extra "chat")) "the 101")
    socket))

(defmacro with-native-socket ((socket port &rest options) &body body)
  `(let ((,socket (native-ws ,port ,@options)))
     (unwind-protect (progn ,@body) (usocket:socket-close ,socket))))

(test native-websocket-handshakes
  "The 101 exactly, with a subprotocol chosen from the client's list; refused
handshakes get 400, or 426 with the version served."
  (with-native-ws (port)
    (with-native-socket (s port))
    (with-native-socket (s port :extra '("Sec-WebSocket-Protocol: superchat, chat")))
    (flet ((status (&rest lines)
             (let ((response (request port (apply #'crlf lines))))
               (values (response-status response) response))))
      (multiple-value-bind (status response)
          (status "GET /echo HTTP/1.1" "Host: x" "Upgrade: websocket" "Connection: Upgrade"
                  (format nil "Sec-WebSocket-Key: ~A" *rfc-key*) "Sec-WebSocket-Version: 8")
        (is (= 426 status))
        (is (equal "13" (header response "Sec-WebSocket-Version"))))
      (is (= 400 (status "GET /echo HTTP/1.1" "Host: x" "Upgrade: websocket" "Connection: Upgrade"
                         "Sec-WebSocket-Key: short" "Sec-WebSocket-Version: 13")))
      (is (= 400 (status "GET /echo HTTP/1.1" "Host: x" "Upgrade: websocket" "Connection: keep-alive"
                         (format nil "Sec-WebSocket-Key: ~A" *rfc-key*) "Sec-WebSocket-Version: 13")))
      (is (= 400 (status "POST /echo HTTP/1.1" "Host: x" "Upgrade: websocket" "Connection: Upgrade"
                         (format nil "Sec-WebSocket-Key: ~A" *rfc-key*) "Sec-WebSocket-Version: 13"
                         "Content-Length: 0"))))))

(defun check-native-echo (port one-by-one)
  (with-native-socket (s port :one-by-one one-by-one)
    (dolist (n (if one-by-one '(0 5 125 126) '(0 1 125 126 65535 65536 200000)))
      (let ((text (make-string n :initial-element #\é)))
        (ws-send s (ws-frame 1 (sb-ext:string-to-octets text :external-format :utf-8))
                 :one-by-one one-by-one)
        (expect-octets s (server-frame 1 (sb-ext:string-to-octets text :external-format :utf-8))
                       (format nil "text of ~D characters" n)))
      (let ((binary (make-array n :element-type '(unsigned-byte 8))))
        (dotimes (i n) (setf (aref binary i) (mod (* 31 i) 256)))
        (ws-send s (ws-frame 2 binary) :one-by-one one-by-one)
        (expect-octets s (server-frame 2 binary) (format nil "binary of ~D octets" n))))
    ;; fragments, a ping and an unsolicited pong between them
    (ws-send s (concat-octets (ws-frame 1 (octets "frag") :fin nil) (ws-frame 9 (octets "p1"))
                              (ws-frame 0 (octets "men") :fin nil) (ws-frame 10 (octets "x"))
                              (ws-frame 0 #() :fin nil))
             :one-by-one one-by-one)
    (ws-send s (ws-frame 0 (octets "t")) :one-by-one one-by-one)
    (expect-octets s (concat-octets (server-frame 10 (octets "p1")) (server-frame 1 (octets "fragment")))
                   "pong, then the whole message")
    ;; the server's own ping
    (ws-send s (ws-frame 1 (octets "pings")) :one-by-one one-by-one)
    (expect-octets s (server-frame 9 (octets "hey")) "the server's ping")
    ;; the close handshake
    (ws-send s (ws-frame 8 (ws-close-payload 1000 "bye")) :one-by-one one-by-one)
    (expect-octets s (server-frame 8 (ws-close-payload 1000)) "close")
    (is (closed-by-peer-p s))))

(test native-websocket-messages
  "Messages at each length form, fragments with control frames between them,
pings both ways and the close handshake, whole and one octet at a time;
ON-CLOSE gets the client's code and reason."
  (with-native-ws (port)
    (check-native-echo port nil)
    (check-native-echo port t)
    (is (wait-until (lambda () (= 2 (length *ws-closes*)))))
    (is (equal '((1000 "bye") (1000 "bye")) *ws-closes*))
    (with-native-socket (s port)
      (let ((big (make-array (* 16 1024 1024) :element-type '(unsigned-byte 8))))
        (dotimes (i (length big)) (setf (aref big i) (mod i 251)))
        (ws-send s (ws-frame 2 big))
        (expect-octets s (server-frame 2 big) "16 MiB")))))

(test native-websocket-closes-from-the-server
  "WS-CLOSE from the app: its close frame, the client's answer, then the end
of the connection; ON-CLOSE gets the server's code.  A send from another
thread arrives; none after the close."
  (with-native-ws (port)
    (with-native-socket (s port)
      (is (wait-until (lambda () *ws-last*)))
      (sb-thread:join-thread (sb-thread:make-thread (lambda () (gallop:ws-send *ws-last* "hi"))))
      (expect-octets s (server-frame 1 (octets "hi")) "from another thread")
      (ws-send s (ws-frame 1 (octets "close-me")))
      (expect-octets s (server-frame 8 (ws-close-payload 4001 "asked")) "the server's close")
      (is (null (gallop:ws-send *ws-last* "late")))
      (ws-send s (ws-frame 8 (ws-close-payload 4001)))
      (is (closed-by-peer-p s))
      (is (wait-until (lambda () (equal '((4001 "asked")) *ws-closes*)))))))

(defparameter *protocol-errors*
  `(("an unmasked frame" 1002 ,(ws-frame 1 (octets "a") :mask nil))
    ("RSV1 set" 1002 ,(let ((f (ws-frame 1 (octets "a")))) (setf (aref f 0) #xC1) f))
    ("opcode 3" 1002 ,(ws-frame 3 (octets "a")))
    ("opcode 11" 1002 ,(ws-frame 11 (octets "a")))
    ("a fragmented ping" 1002 ,(ws-frame 9 (octets "a") :fin nil))
    ("a ping of 126 octets" 1002 ,(ws-frame 9 (make-array 126 :initial-element 1)))
    ("a continuation first" 1002 ,(ws-frame 0 (octets "a")))
    ("a new message in fragments" 1002 ,(concat-octets (ws-frame 1 (octets "a") :fin nil)
                                                       (ws-frame 1 (octets "b"))))
    ("invalid UTF-8" 1007 ,(ws-frame 1 #(#xCE #xBA #xE1 #xBD #xB9 #xED #xA0 #x80)))
    ("UTF-8 cut at the end" 1007 ,(ws-frame 1 #(#x41 #xE1 #xBD)))
    ("UTF-8 cut across fragments, then bad" 1007
     ,(concat-octets (ws-frame 1 #(#xE1) :fin nil) (ws-frame 0 #(#x41))))
    ("close code 999" 1002 ,(ws-frame 8 (ws-close-payload 999)))
    ("close code 1005" 1002 ,(ws-frame 8 (ws-close-payload 1005)))
    ("close code 2000" 1002 ,(ws-frame 8 (ws-close-payload 2000)))
    ("a close of one octet" 1002 ,(ws-frame 8 #(3)))
    ("a close reason in bad UTF-8" 1007 ,(ws-frame 8 (concat-octets (ws-close-payload 1000) #(#xFF))))
    ("a 64-bit length with its high bit set" 1002
     ,(concatenate '(vector (unsigned-byte 8)) #(#x82 #xFF #x80 0 0 0 0 0 0 0 1 2 3 4)))
    ("a message over the limit" 1009 ,(concatenate '(vector (unsigned-byte 8))
                                                   #(#x82 #xFF 0 0 0 0 1 16 0 1 1 2 3 4))))
  "Frames the server must close on, with the code it must close with.")

(test native-websocket-protocol-errors
  "Each protocol error closes with its code (then the connection), whole and
one octet at a time; the server keeps serving."
  (with-native-ws (port)
    (loop for (what code frame) in *protocol-errors*
          do (dolist (one-by-one '(nil t))
               (with-native-socket (s port)
                 (ws-send s (coerce frame 'octets-vector) :one-by-one one-by-one)
                 (expect-close-code s code)))
             (is (wait-until (lambda () (= 2 (count code *ws-closes* :key #'first))))
                 "~A: ON-CLOSE saw ~S" what *ws-closes*)
             (setf *ws-closes* nil))
    (is (string= "plain" (body-string (get-request port "/plain"))))))

(test websocket-memory-follows-what-came
  "A frame head declaring 16 MiB, then 100 octets of it: the reader holds
about what came, not what was declared."
  (let* ((got nil)
         (ws (gallop::%make-websocket :max-message (* 17 1024 1024)
                                      :on-message (lambda (ws message) (declare (ignore ws))
                                                    (setf got (length message)))))
         (frame (ws-frame 2 (make-array (* 16 1024 1024) :element-type '(unsigned-byte 8))))
         (head (+ 2 8 4)))
    (gallop::read-frames ws frame 0 (+ head 100))
    (is (< (length (gallop::ws-message ws)) 4096) "~D octets held" (length (gallop::ws-message ws)))
    (gallop::read-frames ws frame (+ head 100) (length frame))
    (is (eql (* 16 1024 1024) got) "the message came as ~S octets" got)))

(test websocket-messages-within-the-body-budget
  "Messages being assembled count in the server's body budget: past it the
WebSocket closes with 1013 and the budget is given back; others go on."
  (with-native-ws-options (port :body-budget (* 256 1024))
    (with-native-socket (s port)
      (ws-send s (ws-frame 2 (filled (* 512 1024))))
      (expect-close-code s 1013))
    (is (wait-until (lambda () (zerop (stat *ws-server* :body-bytes)))))
    (with-native-socket (s port)
      (ws-send s (ws-frame 2 (filled (* 100 1024))))
      (expect-octets s (server-frame 2 (filled (* 100 1024))) "within the budget"))))

;;; permessage-deflate (RFC 7692)

(test websocket-deflate-agreement
  "The first permessage-deflate offer the server can honour is accepted, with
no context takeover either way; offers with unknown, repeated or malformed
parameters are declined."
  (let ((plain "permessage-deflate; server_no_context_takeover; client_no_context_takeover"))
    (loop for (offer response window)
            in `(("permessage-deflate" ,plain 15)
                 ("permessage-deflate; client_max_window_bits" ,plain 15)
                 ("PerMessage-Deflate ;client_max_window_bits=10 ; server_no_context_takeover" ,plain 15)
                 ("permessage-deflate; server_max_window_bits=12"
                  ,(format nil "~A; server_max_window_bits=12" plain) 12)
                 ("permessage-deflate; server_max_window_bits=\"9\""
                  ,(format nil "~A; server_max_window_bits=9" plain) 9)
                 ("x-webkit-deflate-frame, permessage-deflate" ,plain 15)
                 ("permessage-deflate; server_max_window_bits=8, permessage-deflate" ,plain 15)
                 ("permessage-deflate; server_max_window_bits" nil)
                 ("permessage-deflate; server_max_window_bits=16" nil)
                 ("permessage-deflate; server_max_window_bits=08" nil)
                 ("permessage-deflate; client_max_window_bits=7" nil)
                 ("permessage-deflate; server_no_context_takeover=1" nil)
                 ("permessage-deflate; client_no_context_takeover; client_no_context_takeover" nil)
                 ("permessage-deflate; mux" nil)
                 ("permessage-deflate;" nil)
                 ("x-webkit-deflate-frame" nil)
                 ("" nil))
          do (multiple-value-bind (got bits) (gallop::deflate-agreement offer)
               (is (equal response got) "~S: ~S" offer got)
               (when response (is (eql window bits) "~S: window ~S" offer bits))))))

(defun inflated (hex &key (limit 1000) (charge (constantly t)))
  "What INFLATE-MESSAGE makes of the octets HEX names: a string, or its keyword."
  (let* ((octets (concat-octets (loop for i from 0 below (length hex) by 2
                                      collect (parse-integer hex :start i :end (+ i 2) :radix 16))
                                #(0 0 #xFF #xFF)))
         (out (gallop::inflate-message octets (length octets) limit charge)))
    (if (symbolp out)
        out
        (map 'string #'code-char (subseq out 0 (nth-value 1 (gallop::inflate-message
                                                              octets (length octets) limit charge)))))))

(test websocket-deflate-octets
  "RFC 7692's examples inflate to \"Hello\" (7.2.3.1-7.2.3.4: compressed, cut
in two, a stored block, BFINAL set); data that is not deflate or stops
inside a block is refused, as is more than the limit or the budget.
Compressing gives what inflates back, and nothing that would not shrink."
  (flet ((hex (list) (apply #'concatenate 'string list)))
    (is (equal "Hello" (inflated "f248cdc9c90700")))
    (is (equal "Hello" (inflated (hex '("f248cd" "c9c90700")))))
    (is (equal "Hello" (inflated "000500faff48656c6c6f00")))
    (is (equal "Hello" (inflated "f348cdc9c90700")))
    (is (equal "" (inflated "00")))
    (is (equal "" (inflated "")))
    (is (eq :invalid (inflated "ffffff")))
    (is (eq :invalid (inflated "f248cd")))
    (is (eq :invalid (inflated "f348cdc9c90700deadbeef")) "octets after the final block")
    (is (eq :too-big (inflated "f248cdc9c90700" :limit 4)))
    (is (equal "Hello" (inflated "f248cdc9c90700" :limit 5)))
    (is (eq :no-memory (inflated "f248cdc9c90700" :charge (constantly nil)))))
  (let ((message (octets (format nil "~{~A~}" (loop repeat 40 collect "Hello, ")))))
    (multiple-value-bind (deflated length) (gallop::deflate-message message 15)
      (is (and deflated (< length 40)) "280 octets of text compressed to ~S" length)
      (let ((in (concat-octets (subseq deflated 0 length) #(0 0 #xFF #xFF))))
        (multiple-value-bind (out n) (gallop::inflate-message in (length in) 1000 (constantly t))
          (is (equalp message (subseq out 0 n)))))))
  ;; Round trips at the sizes where the inflater's buffer fills exactly.
  (let ((state (sb-ext:seed-random-state 3)))
    (dolist (n '(300 4095 4096 4097 16384 65535 65536 65537 (* 1024 1024)))
      (let ((n (eval n)))
        (dolist (kind '(:same :pattern :text))
          (let ((m (make-array n :element-type '(unsigned-byte 8))))
            (dotimes (i n)
              (setf (aref m i) (ecase kind
                                 (:same 65)
                                 (:pattern (mod (* i 7) 251))
                                 (:text (+ 97 (random 6 state))))))
            (multiple-value-bind (deflated length) (gallop::deflate-message m 15)
              (let ((in (concat-octets (subseq deflated 0 length) #(0 0 #xFF #xFF))))
                (multiple-value-bind (out got)
                    (gallop::inflate-message in (length in) (* 2 n) (constantly t))
                  (is (and (not (symbolp out)) (= n got) (equalp m (subseq out 0 got)))
                      "~D octets, ~(~A~): ~S" n kind (if (symbolp out) out got))))))))))
  ;; What a saved image does: pooled streams freed, zlib opened again.
  (gallop::forget-zlib)
  (is (equal "Hello" (inflated "f248cdc9c90700")))
  (let ((noise (make-array 1000 :element-type '(unsigned-byte 8))))
    (let ((state (sb-ext:seed-random-state 7)))
      (dotimes (i 1000) (setf (aref noise i) (random 256 state))))
    (is (null (gallop::deflate-message noise 15)))))

(defparameter *deflate-offer* "Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits")

(defun deflate-ws (port &key one-by-one)
  "A connection to PORT's /echo with permessage-deflate agreed, the 101 exact."
  (let ((socket (connect port)))
    (ws-send socket (octets (ws-handshake "/echo" *deflate-offer*)) :one-by-one one-by-one)
    (expect-octets socket
                   (octets (crlf "HTTP/1.1 101 Switching Protocols" "Upgrade: websocket"
                                 "Connection: Upgrade"
                                 (format nil "Sec-WebSocket-Accept: ~A" *rfc-accept*)
                                 (format nil "Sec-WebSocket-Extensions: permessage-deflate; ~
                                              server_no_context_takeover; ~
                                              client_no_context_takeover")))
                   "the 101 with permessage-deflate")
    socket))

(defun hex-octets (hex)
  (coerce (loop for i from 0 below (length hex) by 2
                collect (parse-integer hex :start i :end (+ i 2) :radix 16))
          'octets-vector))

(test native-websocket-deflate
  "With permessage-deflate agreed: compressed messages (whole, in fragments,
a stored block, BFINAL set) arrive inflated, whole and one octet at a time;
a short answer goes uncompressed, a long one compressed (RSV1) and inflates
back; RSV1 where it cannot be, data that does not inflate, or inflates past
the limit, or text that is not UTF-8 once inflated, closes with its code."
  (with-native-ws (port)
    (dolist (one-by-one '(nil t))
      (let ((s (deflate-ws port :one-by-one one-by-one)))
        (unwind-protect
             (progn
               (loop for (frames pong)
                       in (list (list (ws-frame 1 (hex-octets "f248cdc9c90700") :rsv1 t) nil)
                                (list (concat-octets
                                       (ws-frame 1 (hex-octets "f248cd") :rsv1 t :fin nil)
                                       (ws-frame 9 (octets "p"))
                                       (ws-frame 0 (hex-octets "c9c90700")))
                                      t)
                                (list (ws-frame 1 (hex-octets "000500faff48656c6c6f00") :rsv1 t) nil)
                                (list (ws-frame 1 (hex-octets "f348cdc9c90700") :rsv1 t) nil)
                                (list (ws-frame 1 (octets "Hello")) nil))
                     do (ws-send s frames :one-by-one one-by-one)
                        (when pong
                          (expect-octets s (server-frame 10 (octets "p")) "the pong"))
                        (expect-octets s (server-frame 1 (octets "Hello")) "Hello, short: uncompressed"))
               (let ((long (octets (format nil "~{~A~}" (loop repeat 40 collect "Hello, ")))))
                 (ws-send s (ws-frame 1 long) :one-by-one one-by-one)
                 (let* ((head (read-octets s 2))
                        (payload (read-octets s (logand (aref head 1) 127)))
                        (in (concat-octets payload #(0 0 #xFF #xFF))))
                   (is (= #xC1 (aref head 0)) "a long answer is compressed: ~S" head)
                   (multiple-value-bind (out n) (gallop::inflate-message in (length in) 1000
                                                                         (constantly t))
                     (is (equalp long (subseq out 0 n)))))))
          (usocket:socket-close s))))
    (flet ((deflated (octets)
             (multiple-value-bind (out length) (gallop::deflate-message octets 15)
               (subseq out 0 length))))
      (let ((bomb (deflated (make-array (* 18 1024 1024) :element-type '(unsigned-byte 8))))
            (bad-text (deflated (concat-octets (filled 100 65) #(#xFF)))))
        (loop for (what code frames)
                in `(("RSV1 on a continuation" 1002
                      ,(concat-octets (ws-frame 1 (hex-octets "f248cd") :rsv1 t :fin nil)
                                      (ws-frame 0 (hex-octets "c9c90700") :rsv1 t)))
                     ("RSV1 on a ping" 1002 ,(ws-frame 9 #() :rsv1 t))
                     ("not deflate data" 1007 ,(ws-frame 2 (hex-octets "ffffff") :rsv1 t))
                     ("deflate data cut in a block" 1007 ,(ws-frame 2 (hex-octets "f248cd") :rsv1 t))
                     ("18 MiB inflated" 1009 ,(ws-frame 2 bomb :rsv1 t))
                     ("invalid UTF-8 once inflated" 1007 ,(ws-frame 1 bad-text :rsv1 t)))
              do (let ((s (deflate-ws port)))
                   (unwind-protect
                        (progn (ws-send s frames)
                               (expect-close-code s code))
                     (usocket:socket-close s)))
                 (is (wait-until (lambda () (find code *ws-closes* :key #'first)))
                     "~A: ON-CLOSE saw ~S" what *ws-closes*)
                 (setf *ws-closes* nil))))
    (is (wait-until (lambda () (zerop (stat *ws-server* :body-bytes)))))))

(test native-websocket-deflate-with-python
  "Debian's python3-websockets offers permessage-deflate by default: it is
agreed with no context takeover either way, and messages of each kind,
compressed both ways, come back whole."
  (with-native-ws (port)
    (is (equal '("agreed permessage-deflate server_no_context_takeover True client_no_context_takeover True"
                 "short hello" "json 2190 True" "big True" "noise True" "fragments True"
                 "closed 4000 ")
               (python-websockets "ws-deflate-client.py" port)))))

(test websocket-inflated-messages-within-the-body-budget
  "A small compressed message that inflates to much more: the inflated
octets and the string handed to the app count in the body budget, so past
it the WebSocket closes with 1013 (not the heap), and all is given back."
  (with-native-ws-options (port :body-budget (* 1024 1024))
    (let ((s (deflate-ws port))
          (text (multiple-value-bind (out length)
                    (gallop::deflate-message (filled (* 512 1024) 65) 15)
                  (subseq out 0 length))))
      (unwind-protect
           (progn (is (< (length text) 1024))
                  (ws-send s (ws-frame 1 text :rsv1 t))
                  (expect-close-code s 1013))
        (usocket:socket-close s)))
    (is (wait-until (lambda () (zerop (stat *ws-server* :body-bytes)))))
    (let ((s (deflate-ws port))
          (small (multiple-value-bind (out length)
                     (gallop::deflate-message (filled (* 64 1024) 65) 15)
                   (subseq out 0 length))))
      (unwind-protect
           (progn (ws-send s (ws-frame 2 small :rsv1 t))
                  (let ((head (read-octets s 2)))
                    (is (= #xC2 (aref head 0)) "the 64 KiB echo, compressed: ~S" head)))
        (usocket:socket-close s)))))
