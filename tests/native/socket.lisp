;;;; socket.lisp -- the connection taken as a socket (src/native/socket.lisp,
;;;; src/core/loop/upgrade.lisp): an app that switches protocols writes its own
;;;; 101 and then octets as it likes, from any thread, and is given what the
;;;; client sends on a worker.  Checked over a real socket, byte by byte,
;;;; with a toy protocol (echo), and the WebSocket frame assembly on octet
;;;; vectors.

(in-package #:gallop-tests)

(in-suite native)

(defparameter *switching*
  (crlf "HTTP/1.1 101 Switching Protocols" "Upgrade: echo" "Connection: Upgrade"))

(defvar *socket-events* nil
  "What the echo app saw: :CLOSED for each close callback, in order.")
(defvar *socket-events-lock* (sb-thread:make-mutex :name "socket events"))
(defvar *last-socket* nil "The socket the echo app took last.")

(defun note-socket-event (event)
  (sb-thread:with-mutex (*socket-events-lock*) (push event *socket-events*)))

(defun socket-event-count (event)
  (sb-thread:with-mutex (*socket-events-lock*) (count event *socket-events*)))

(defun echo-protocol-app (env)
  "Switch to a toy protocol at /echo: echo what comes; on \"bye\", answer
\"ciao\" and close.  At /echo-waits the same, after waiting for the
client's next octets (WAIT-FOR-CLIENT-OCTETS) once it wrote its 101.
Anything else: 200 \"plain\"."
  (if (member (getf env :path-info) '("/echo" "/echo-waits") :test #'string=)
      (let ((socket (gallop:env-socket env)))
        (setf *last-socket* socket
              (gallop:socket-close-callback socket) (lambda () (note-socket-event :closed))
              (gallop:socket-read-callback socket)
              (lambda (octets &key start end)
                (let ((text (map 'string #'code-char (subseq octets start end))))
                  (if (search "bye" text)
                      (progn (gallop:socket-write socket "ciao")
                             (gallop:socket-close socket))
                      (gallop:socket-write socket (subseq octets start end))))))
        (gallop:socket-write socket *switching*)
        (when (string= (getf env :path-info) "/echo-waits")
          (wait-for-client-octets (gallop::exchange-connection socket)))
        (lambda (responder) (declare (ignore responder))))
      '(200 (:content-type "text/plain") ("plain"))))

(defun upgrade-request (path &optional (extra ""))
  (concatenate 'string
               (crlf (format nil "GET ~A HTTP/1.1" path) "Host: 127.0.0.1"
                     "Upgrade: echo" "Connection: Upgrade")
               extra))

(defun read-exact-octets (socket n &key (timeout 5))
  "N octets from SOCKET as a latin-1 string, or what came before TIMEOUT."
  (let ((stream (usocket:socket-stream socket))
        (out (make-string-output-stream)))
    (setf (sb-impl::fd-stream-timeout stream) (float timeout 1.0))
    (handler-case (loop repeat n
                        for b = (read-byte stream nil nil)
                        while b do (write-char (code-char b) out))
      (sb-sys:io-timeout () nil))
    (get-output-stream-string out)))

(test socket-switches-protocols-exactly
  "The app's own 101, then the octets the client sent with its head (first),
then each message echoed, in order; \"bye\" gets \"ciao\" and the end of the
connection; the close callback runs once; the server keeps serving HTTP."
  (setf *socket-events* nil)
  (with-app (server #'echo-protocol-app)
    (let* ((port (native-port server))
           (socket (connect port)))
      (unwind-protect
           (progn
             (send socket (upgrade-request "/echo" "early"))
             (is (string= (concatenate 'string *switching* "early")
                          (read-exact-octets socket (+ (length *switching*) 5))))
             (send socket "hello")
             (is (string= "hello" (read-exact-octets socket 5)))
             (is (= 1 (stat server :upgraded)))
             (is (string= "plain" (body-string (get-request port "/plain"))))
             (send socket "bye")
             (is (string= "ciao" (read-exact-octets socket 4)))
             (is (closed-by-peer-p socket))
             (is (wait-until (lambda () (= 1 (socket-event-count :closed)))))
             (is (wait-until (lambda () (zerop (stat server :upgraded)))))
             (is (= 1 (stat server :upgrades)))
             (sleep 0.2)
             (is (= 1 (socket-event-count :closed)) "the close callback ran more than once"))
        (usocket:socket-close socket)))))

(test socket-reads-what-came-while-the-app-ran
  "Octets the client sent while the app still ran, in the socket before the
engine read them (their event came while the app's worker owned the
connection), reach the read callback, after the 101."
  (setf *socket-events* nil)
  (with-globals ((*handler-waiting* (sb-thread:make-semaphore))
                 (*client-octets-sent* (sb-thread:make-semaphore)))
    (with-app (server #'echo-protocol-app)
      (let ((socket (connect (native-port server))))
        (unwind-protect
             (progn
               (send socket (upgrade-request "/echo-waits"))
               (send-while-handler-waits socket "early")
               (is (string= (concatenate 'string *switching* "early")
                            (read-exact-octets socket (+ (length *switching*) 5))))
               (send socket "bye")
               (is (string= "ciao" (read-exact-octets socket 4)))
               (is (closed-by-peer-p socket)))
          (usocket:socket-close socket))))))

(test socket-writes-from-other-threads
  "Writes from a timer on another worker and from a thread of the app's own
arrive whole and in the order they were made; a client that goes away ends
the socket: its close callback runs, its fd is closed."
  (setf *socket-events* nil)
  (with-app (server #'echo-protocol-app)
    (let ((socket (connect (native-port server))))
      (unwind-protect
           (progn
             (send socket (upgrade-request "/echo"))
             (is (string= *switching* (read-exact-octets socket (length *switching*))))
             (let ((taken *last-socket*)
                   (done (sb-thread:make-semaphore)))
               (gallop:after 0.01 (lambda ()
                                    (gallop:socket-write taken "from a timer;")
                                    (sb-thread:signal-semaphore done))
                             :server server)
               (sb-thread:wait-on-semaphore done :timeout 5)
               (sb-thread:join-thread
                (sb-thread:make-thread (lambda ()
                                         (dotimes (i 100)
                                           (gallop:socket-write taken (format nil "~D," i))))))
               (is (string= (format nil "from a timer;~{~D,~}" (loop for i below 100 collect i))
                            (read-exact-octets socket (+ 13 10 (* 2 90) (* 100 1)))))))
        (usocket:socket-close socket))
      (is (wait-until (lambda () (= 1 (socket-event-count :closed)))))
      (is (wait-until (lambda () (zerop (stat server :open)))))
      (is (null (gallop:socket-write *last-socket* "late")) "a write after the end"))))

(test socket-backpressure-and-send-limit
  "A client that reads nothing: each write says how much waits for it, and
once a backlog passes the send limit the write answers NIL and the
connection is closed (counted as a slow client)."
  (setf *socket-events* nil)
  (with-app (server #'echo-protocol-app :upgraded-send-limit (* 256 1024))
    (let ((socket (connect (native-port server)))
          (chunk (make-array (* 64 1024) :element-type '(unsigned-byte 8) :initial-element 65)))
      (unwind-protect
           (progn
             (send socket (upgrade-request "/echo"))
             (is (string= *switching* (read-exact-octets socket (length *switching*))))
             (let* ((taken *last-socket*)
                    (answers (loop repeat 2000
                                   for pending = (gallop:socket-write taken chunk)
                                   collect pending
                                   while pending)))
               (is (null (car (last answers))) "never refused in 128 MiB")
               (is (some (lambda (n) (and n (> n (* 256 1024)))) answers)
                   "the backlog was never seen past the limit")
               (is (> (length answers) 2))
               (is (wait-until (lambda () (= 1 (socket-event-count :closed)))))
               (is (= 1 (stat server :slow-clients)))))
        (usocket:socket-close socket)))))

(test socket-idle-timeout
  "With UPGRADED-IDLE-TIMEOUT, a client that sends nothing is closed; with
the default (60 s), it is not (checked past the same time)."
  (setf *socket-events* nil)
  (with-app (server #'echo-protocol-app :upgraded-idle-timeout 1)
    (let ((socket (connect (native-port server))))
      (unwind-protect
           (progn
             (send socket (upgrade-request "/echo"))
             (is (string= *switching* (read-exact-octets socket (length *switching*))))
             (is (closed-by-peer-p socket :timeout 5))
             (is (wait-until (lambda () (= 1 (socket-event-count :closed))))))
        (usocket:socket-close socket))))
  (with-app (server #'echo-protocol-app :idle-timeout 1)
    (let ((socket (connect (native-port server))))
      (unwind-protect
           (progn
             (send socket (upgrade-request "/echo"))
             (is (string= *switching* (read-exact-octets socket (length *switching*))))
             (is (not (closed-by-peer-p socket :timeout 2.5)))
             (send socket "still")
             (is (string= "still" (read-exact-octets socket 5))))
        (usocket:socket-close socket)))))

(test socket-not-after-a-body
  "A request with a body cannot switch protocols: its octets after the head
would be read as the new protocol's.  The app's attempt is an error (500)."
  (with-app (server #'echo-protocol-app)
    (let ((response (request (native-port server)
                             (concatenate 'string
                                          (crlf "POST /echo HTTP/1.1" "Host: 127.0.0.1"
                                                "Upgrade: echo" "Connection: Upgrade"
                                                "Content-Length: 5")
                                          "hello"))))
      (is (= 500 (response-status response))))))

;;; Whole WebSocket frames for websocket-driver (FRAME-READER), on octet vectors

(defun ws-frame (opcode payload &key (fin t) (mask #(1 2 3 4)) rsv1)
  "A client's WebSocket frame (RFC 6455, 5.2): masked unless MASK is NIL;
RSV1 set (a compressed message, RFC 7692) with RSV1."
  (let* ((payload (coerce payload '(vector (unsigned-byte 8))))
         (n (length payload))
         (out (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0)))
    (vector-push-extend (logior (if fin #x80 0) (if rsv1 #x40 0) opcode) out)
    (let ((bit (if mask #x80 0)))
      (cond ((< n 126) (vector-push-extend (logior bit n) out))
            ((< n 65536) (vector-push-extend (logior bit 126) out)
             (vector-push-extend (ldb (byte 8 8) n) out) (vector-push-extend (ldb (byte 8 0) n) out))
            (t (vector-push-extend (logior bit 127) out)
               (loop for shift from 56 downto 0 by 8
                     do (vector-push-extend (ldb (byte 8 shift) n) out)))))
    (when mask (loop for m across mask do (vector-push-extend m out)))
    (loop for b across payload for i from 0
          do (vector-push-extend (if mask (logxor b (aref mask (mod i 4))) b) out))
    (coerce out '(simple-array (unsigned-byte 8) (*)))))

(defun concat-octets (&rest vectors)
  (coerce (apply #'concatenate 'vector vectors) '(simple-array (unsigned-byte 8) (*))))

(test frame-sizes
  "FRAME-SIZE reads the three length forms, with and without a mask, and
says NIL while the length is incomplete."
  (dolist (n '(0 1 125 126 127 65535 65536 70000))
    (dolist (mask '(nil #(9 8 7 6)))
      (let ((frame (ws-frame 2 (make-array n :initial-element 7) :mask mask)))
        (is (= (length frame) (gallop::frame-size frame 0 (length frame))) "~D ~A" n mask)
        (let ((head (cond ((< n 126) 2) ((< n 65536) 4) (t 10))))
          (loop for cut from 0 below head
                do (is (null (gallop::frame-size frame 0 cut)) "~D cut at ~D" n cut)))))))

;;; FRAME-LENGTH (src/native/websocket-frames.lisp) is the one reader of a
;;; frame head's length, for the socket's whole frames (FRAME-SIZE) and the
;;; native WebSocket's reader (BEGIN-FRAME).

(defun octet-vector (&rest octets)
  (coerce octets '(simple-array (unsigned-byte 8) (*))))

(test frame-lengths
  "FRAME-LENGTH reads the 7-, 16- and 64-bit forms at any START, with where
the masking key begins, and says NIL while the length is incomplete.  A
longer form than needed is read as sent, as is a 64-bit length with its
high bit set (the WebSocket reader refuses that one: *PROTOCOL-ERRORS*)."
  (flet ((decode (start &rest octets)
           (let ((v (apply #'octet-vector octets)))
             (multiple-value-list (gallop::frame-length v start (length v))))))
    (is (equal '(0 2) (decode 0 #x81 0)))
    (is (equal '(125 2) (decode 0 #x81 125)))
    (is (equal '(125 2) (decode 0 #x81 (logior #x80 125))) "the mask bit is not length")
    (is (equal '(126 4) (decode 0 #x82 126 0 126)))
    (is (equal '(65535 4) (decode 0 #x82 (logior #x80 126) #xFF #xFF)))
    (is (equal '(65536 10) (decode 0 #x82 127 0 0 0 0 0 1 0 0)))
    (is (equal (list (1- (expt 2 63)) 10) (decode 0 #x82 127 #x7F #xFF #xFF #xFF #xFF #xFF #xFF #xFF)))
    (is (equal '(300 4) (decode 2 9 9 #x82 126 1 44)) "at START")
    ;; Not the shortest form: read as sent.
    (is (equal '(5 4) (decode 0 #x82 126 0 5)))
    (is (equal '(5 10) (decode 0 #x82 127 0 0 0 0 0 0 0 5)))
    ;; The high bit: read as sent.
    (is (equal (list (expt 2 63) 10) (decode 0 #x82 (logior #x80 127) #x80 0 0 0 0 0 0 0)))
    (is (equal (list (1- (expt 2 64)) 10) (decode 0 #x82 127 255 255 255 255 255 255 255 255))))
  (dolist (head (list (octet-vector #x82 5) (octet-vector #x82 126 1 44)
                      (octet-vector #x82 127 0 0 0 0 0 0 1 0)))
    (loop for cut from 0 below (length head)
          do (is (null (gallop::frame-length head 0 cut)) "~S cut at ~D" head cut))))

(test close-payload-cuts-between-characters
  "A close frame's reason is cut to 123 octets before a character that would
not fit whole, so the peer always gets UTF-8."
  (flet ((payload (reason) (gallop::close-payload 1011 reason)))
    (is (equalp (octet-vector 3 243 104 105) (payload "hi")))
    (is (= 125 (length (payload (make-string 200 :initial-element #\a)))))
    ;; 122 ASCII, then a 2-octet character: octets 123 and 124 of the reason.
    (let ((p (payload (concatenate 'string (make-string 122 :initial-element #\a)
                                   (string (code-char #xE9)) "z"))))
      (is (= 124 (length p)) "~D" (length p))
      (is (every (lambda (o) (= o 97)) (subseq p 2))))
    ;; Three-octet characters: 41 fill 123 octets exactly; of 45, 41 fit.
    (dolist (n '(41 45))
      (let* ((p (payload (make-string n :initial-element (code-char #x20AC))))
             (reason (subseq p 2)))
        (is (= (* 3 (min n 41)) (length reason)) "~D: ~D" n (length reason))
        (is (string= (make-string (min n 41) :initial-element (code-char #x20AC))
                     (sb-ext:octets-to-string reason :external-format :utf-8)))))))

(test frame-lengths-as-each-reader-takes-them
  "Lengths in a longer form than needed are taken by both readers; a length
with its high bit set is passed on whole by the socket (over its limit) and
refused by the WebSocket reader (*PROTOCOL-ERRORS*, over a real socket)."
  ;; A mask of zeros: the payload goes as it is.
  (let ((text (octet-vector #x81 (logior #x80 126) 0 5 0 0 0 0 104 101 108 108 111))
        (binary (octet-vector #x82 (logior #x80 127) 0 0 0 0 0 0 0 3 0 0 0 0 1 2 3))
        (huge (octet-vector #x82 (logior #x80 127) #x80 0 0 0 0 0 0 0 0 0 0 0)))
    (is (eql 13 (gallop::frame-size text 0 (length text))))
    (is (eql 17 (gallop::frame-size binary 0 (length binary))))
    (is (eql (+ 14 (expt 2 63)) (gallop::frame-size huge 0 (length huge))))
    (is (eql (length huge) (gallop::whole-frames-end huge 0 (length huge))))
    (let* ((got '())
           (ws (gallop::%make-websocket :max-message 1000
                                        :on-message (lambda (ws message)
                                                      (declare (ignore ws))
                                                      (push message got)))))
      (gallop::read-frames ws text 0 (length text))
      (gallop::read-frames ws binary 0 (length binary))
      (is (equalp '("hello" #(1 2 3)) (reverse got)) "~S" got))))

(test frame-reader-gives-whole-frames
  "Whatever the reads, the callback is given the same frames whole, in order,
each exactly once; a close frame is seen before it is given."
  (let* ((frames (list (ws-frame 1 (octets "hello"))
                       (ws-frame 2 (make-array 70000 :initial-element 5))
                       (ws-frame 9 (octets "ping"))
                       (ws-frame 1 (octets "frag") :fin nil)
                       (ws-frame 0 (octets "ment"))
                       (ws-frame 8 (concat-octets #(3 232) (octets "done")))))
         (stream (apply #'concat-octets frames)))
    (dolist (cuts (list '() '(1) '(3 9) '(20 21 22 70000 70010)
                        (loop for i from 1 below (length stream) by 997 collect i)
                        (loop for i from 1 below 200 collect i)))
      (let* ((given (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0))
             (calls '())
             (close-seen nil)
             (reader (gallop::frame-reader
                      (lambda (octets &key start end)
                        (push (- end start) calls)
                        ;; Each call ends on a frame boundary of the stream.
                        (loop for i from start below end do (vector-push-extend (aref octets i) given)))
                      (lambda () (setf close-seen (length given)))))
             (bounds (append '(0) cuts (list (length stream)))))
        (loop for (a b) on bounds while b
              ;; Given in a scratch buffer the reader must not keep.
              do (let ((scratch (subseq stream a b)))
                   (funcall reader scratch :start 0 :end (length scratch))
                   (fill scratch 0)))
        (is (equalp stream (coerce given 'simple-vector)) "cuts ~A" cuts)
        (let ((ends (loop with sum = 0 for n in (reverse calls) collect (incf sum n)))
              (boundaries (loop with sum = 0 for f in frames collect (incf sum (length f)))))
          (is (subsetp ends boundaries) "a call ended inside a frame: ~A" cuts))
        (is (and close-seen (<= close-seen (- (length stream) (length (car (last frames))))))
            "close frame not seen before it was given: ~A" cuts)))))

(test frame-reader-counts-what-it-keeps
  "The buffer a partial frame waits in is counted as it grows and given back
when emptied; refused, the frame is dropped and REFUSED is called."
  (let* ((held 0) (refused 0) (given 0)
         (reader (gallop::frame-reader (lambda (octets &key start end)
                                         (declare (ignore octets))
                                         (incf given (- end start)))
                                       (lambda ())
                                       :charge (lambda (delta)
                                                 (when (<= (+ held delta) 100000)
                                                   (incf held delta)
                                                   t))
                                       :refused (lambda () (incf refused))))
         (small (ws-frame 2 (make-array 50000 :initial-element 1)))
         (big (ws-frame 2 (make-array 300000 :initial-element 2))))
    (funcall reader small :start 0 :end 20000)
    (is (plusp held))
    (funcall reader small :start 20000 :end (length small))
    (is (= (length small) given))
    (is (zerop held) "~D octets still counted after the frame went" held)
    (loop for start from 0 below (length big) by 40000
          do (funcall reader big :start start :end (min (length big) (+ start 40000))))
    (is (plusp refused))
    (is (= (length small) given) "part of a refused frame was given")))
