;;;; server.lisp -- one benchmarked Lisp server, in its own SBCL process.
;;;;
;;;;   scripts/lisp.sh --load bench/server.lisp --end-toplevel-options KIND PORT SLEEP-MS
;;;;
;;;; KIND is one of
;;;;   stock      stock Hunchentoot: HUNCHENTOOT:EASY-ACCEPTOR, default taskmaster
;;;;              (one thread per connection); loads only Hunchentoot.
;;;;   gallop     Gallop's drop-in acceptor: GALLOP:EASY-ACCEPTOR.
;;;;   gallop-tm  a stock HUNCHENTOOT:EASY-ACCEPTOR with
;;;;              :TASKMASTER (MAKE-INSTANCE 'GALLOP:TASKMASTER).
;;;;   native     Gallop's native app API, GALLOP:START with a Clack-style app
;;;;              doing what /yo does; loads gallop/native (and Hunchentoot,
;;;;              only so that this file reads, not Gallop's Hunchentoot layer).
;;;; All listen on 127.0.0.1:PORT with access and message logging off (set
;;;; BENCH_MESSAGE_LOG=1 to send Hunchentoot's message log, i.e. errors, to
;;;; standard error, which the harness keeps in bench/results/tmp/logs/).
;;;;
;;;; The handler is seed 001's: an easy-handler /yo answering "Hey!" (or
;;;; "Hey NAME!") that calls SLEEP only when the sleep setting is above 0.
;;;; /big answers 1 MiB of octets (no sleep), for every kind: the soak test
;;;; (bench/soak.lisp) reads part of it and hangs up, so that the server's
;;;; writes fail in mid-response.  The benchmark itself only requests /yo.
;;;; The native server also answers /later, 5 s (BENCH_LATER_SECONDS) after
;;;; the request, from a timer (GALLOP:AFTER; bench/pending.lisp).
;;;; /upload reads the request body to its end in 64 KiB pieces and answers
;;;; the number of octets read (native: from :RAW-BODY; Hunchentoot: from
;;;; (HUNCHENTOOT:RAW-POST-DATA :WANT-STREAM T)); /ignore answers "ignored"
;;;; without reading the body.  bench/uploads.lisp (`make bench-uploads`)
;;;; measures the server's memory while clients upload to them.  /error
;;;; signals an error in the handler, and /stream streams /big's 1 MiB in
;;;; 16 KiB writes (Hunchentoot: to SEND-HEADERS's stream; native: a
;;;; writer) (bench/attacks.lisp).  /static answers the checkout's LICENSE
;;;; file (Hunchentoot: HANDLE-STATIC-FILE, whose head goes out through
;;;; SEND-HEADERS; native: a pathname body), for the restart drills
;;;; (tests/stress/restart.lisp).
;;;; WebSockets (bench/attacks.lisp): /ws echoes each message, /feed sends
;;;; every WebSocket on it 16 KiB every 20 ms (BENCH_FEED_BYTES,
;;;; BENCH_FEED_MS) from one thread.  Native: GALLOP:ACCEPT-WEBSOCKET.
;;;; Hunchentoot's kinds serve them only with BENCH_SWITCHED=1, in
;;;; hunchensocket's shape (a handler that answers 101 and keeps its thread,
;;;; reading frames from the request's stream; its SET-TIMEOUTS of 300 s,
;;;; BENCH_SWITCHED_TIMEOUT=none to leave the server's own): see "WebSockets"
;;;; below.
;;;;
;;;; BENCH_TLS_CERT and BENCH_TLS_KEY (PEM files; `make bench-tls`) make
;;;; every kind answer HTTPS only: stock HUNCHENTOOT:EASY-SSL-ACCEPTOR,
;;;; GALLOP:EASY-SSL-ACCEPTOR, HUNCHENTOOT:EASY-SSL-ACCEPTOR with
;;;; GALLOP:TASKMASTER, and GALLOP:START with the certificate.
;;;;
;;;; BENCH_BESIDE_GALLOP=PORT (stock only): the process also loads Gallop
;;;; and runs a GALLOP:EASY-ACCEPTOR on PORT with the same handlers, so that
;;;; tests/hunchentoot/stock.lisp can show the stock acceptor answers as it
;;;; does in a process without Gallop.
;;;; BENCH_REUSE_PORT=1 (native and gallop) binds with :REUSE-PORT, so that
;;;; several of these processes serve one port (tests/stress/restart.lisp).
;;;; Gallop's kinds stop gracefully on SIGTERM (GALLOP:STOP-ON-SIGTERM).
;;;; BENCH_ACCESS_LOG=PATH (native) writes the access log to PATH, in the
;;;; Combined Log Format, or in JSON lines with BENCH_ACCESS_LOG_FORMAT=json.
;;;; BENCH_GALLOP_OPTIONS, a property list, adds any other Gallop settings
;;;; (experiments: "(:max-thread-count 2 :standby-thread-count 2)").
;;;; GALLOP_EPOLL_SETS sets the number of epoll sets (worker groups) of
;;;; Gallop's pool ("cpus": one per usable CPU, the default; 1: one for all
;;;; workers, the pool before the groups; see gallop.core::*group-count*), to
;;;; measure what they bring.
;;;; BENCH_MAX_HEAD_BYTES sets Gallop's :MAX-HEAD-BYTES (default 1 MiB; the
;;;; head-budget benchmark, bench/heads.lisp, lowers it to 65536).
;;;; BENCH_THREAD_IDLE_TIMEOUT (seconds) sets Gallop's :THREAD-IDLE-TIMEOUT
;;;; (default 10), and BENCH_TIMEOUT (seconds) the read and write timeouts,
;;;; from which Gallop's header and keep-alive idle timeouts default (20 s;
;;;; BENCH_IDLE_TIMEOUT still sets the idle one).  The soak test shortens
;;;; them so that soon after its load stops the pool is back to its standby
;;;; threads and no deadline of a closed connection is pending, before it
;;;; measures the server.
;;;;
;;;; Protocol with the harness (bench/run.lisp), on standard input/output:
;;;;   the server prints "READY <pid>" once it listens;
;;;;   "stats" -> one line "STATS <plist>" (GALLOP:STATS, or Hunchentoot's
;;;;              thread count for stock);
;;;;   "gc"    -> a full garbage collection, then "GC <dynamic usage in bytes>"
;;;;              (the soak test calls it before reading RSS, so that
;;;;              samples do not depend on when the last collection ran);
;;;;   "feed"  -> "FEED <plist>": how /feed's thread sends (:MODE :WS-BROADCAST,
;;;;              :WS-SEND or :SWITCHED-STREAMS), the messages it sent to
;;;;              everyone (:TICKS) and to one WebSocket (:SENDS, :ERRORS),
;;;;              and the WebSockets on it now (:CLIENTS);
;;;;   "settings" -> "SETTINGS <plist>": every Gallop setting of this server
;;;;              (stock: its thread limit and read timeout);
;;;;   "heap"  -> "HEAP <dynamic usage> <dynamic space size>" in bytes, without
;;;;              collecting (garbage included: what the heap holds now);
;;;;   "gc-stats" -> "GC-STATS <ms spent in GC> <bytes allocated>", both since
;;;;              the start (per request: the difference over a run);
;;;;   "perf-map" -> writes /tmp/perf-PID.map (bench/perf-map.lisp), so that
;;;;              `perf report` names Lisp functions; "PERF-MAP <lines>";
;;;;   "quit" or end of file -> exit at once.  End of file means the harness is
;;;;   gone, so a crashed harness never leaves a server behind.
;;;; Everything else the process prints (compiler chatter, errors) goes to
;;;; standard error.

(defpackage #:gallop-bench-server
  (:use #:common-lisp))
(in-package #:gallop-bench-server)

(defvar *protocol* sb-sys:*stdout*
  "The harness reads this stream; nothing but protocol lines is written to it.")

;; Keep stdout clean: compiler output and warnings go to stderr.
(setf *standard-output* *error-output*)

(defun user-args ()
  ;; SBCL removes its own options, --end-toplevel-options included.
  (rest sb-ext:*posix-argv*))

(defun die (control &rest args)
  (format *error-output* "~&bench server: ~?~%" control args)
  (finish-output *error-output*)
  (sb-ext:exit :code 2 :abort t))

(defvar *kind*)
(defvar *port*)
(defvar *sleep-ms*)

(let ((args (user-args)))
  (unless (and (= (length args) 3)
               (member (first args) '("stock" "gallop" "gallop-tm" "native") :test #'string=))
    (die "usage: server.lisp --end-toplevel-options stock|gallop|gallop-tm|native PORT SLEEP-MS"))
  (setf *kind* (intern (string-upcase (first args)) :keyword)
        *port* (parse-integer (second args))
        *sleep-ms* (parse-integer (third args))))

;; Stock Hunchentoot loads Hunchentoot alone: Gallop's methods on Hunchentoot's
;; generic functions are not even present in that process (unless
;; BENCH_BESIDE_GALLOP asks for a Gallop acceptor beside it).
(defparameter *beside-port*
  (let ((v (uiop:getenv "BENCH_BESIDE_GALLOP")))
    (and v (plusp (length v)) (eq *kind* :stock) (parse-integer v))))
(asdf:load-system (case *kind* (:stock "hunchentoot") (:native "gallop/native") (t "gallop")))
(when *beside-port*
  (asdf:load-system "gallop"))
;; This file names Hunchentoot's symbols, so the reader needs the package even
;; for the native server, which never starts an acceptor.
(asdf:load-system "hunchentoot")

(defparameter *handler-sleep-seconds* (/ *sleep-ms* 1000)
  "Seed 001's sleep setting.")

(hunchentoot:define-easy-handler (yo :uri "/yo") (name)
  (setf (hunchentoot:content-type*) "text/plain")
  (when (plusp *handler-sleep-seconds*)
    (sleep *handler-sleep-seconds*))
  (format nil "Hey~@[ ~A~]!" name))

(defparameter *big-body*
  (let ((body (make-array (* 1024 1024) :element-type '(unsigned-byte 8))))
    (dotimes (i (length body) body)
      (setf (aref body i) (+ 97 (mod i 26)))))
  "The 1 MiB answer of /big: letters, built once.")

(defparameter *later-seconds*
  (let ((v (uiop:getenv "BENCH_LATER_SECONDS")))
    (if (and v (plusp (length v))) (parse-integer v) 5))
  "How long /later waits before it answers (native only; bench/pending.lisp).")

(hunchentoot:define-easy-handler (later :uri "/later") ()
  ;; Gallop's kinds only (bench/pending.lisp): answered *LATER-SECONDS*
  ;; later by a timer, the worker let go (GALLOP:DEFER-REQUEST).
  (setf (hunchentoot:content-type*) "text/plain")
  (let ((answer (funcall (gallop-symbol "DEFER-REQUEST"))))
    (funcall (gallop-symbol "AFTER") *later-seconds* (lambda () (funcall answer "Hey!")))
    nil))

(defparameter *static-file*
  (uiop:merge-pathnames* "LICENSE" (uiop:pathname-parent-directory-pathname
                                    (uiop:pathname-directory-pathname *load-truename*)))
  "The file /static answers.")

(hunchentoot:define-easy-handler (static :uri "/static") ()
  (hunchentoot:handle-static-file *static-file* "text/plain"))

(hunchentoot:define-easy-handler (big :uri "/big") ()
  (setf (hunchentoot:content-type*) "application/octet-stream")
  *big-body*)

(defconstant +stream-piece-bytes+ 16384
  "The size of /stream's writes.")

(hunchentoot:define-easy-handler (stream-big :uri "/stream") ()
  (setf (hunchentoot:content-type*) "application/octet-stream"
        (hunchentoot:content-length*) (length *big-body*))
  (let ((out (hunchentoot:send-headers)))
    (loop for start from 0 below (length *big-body*) by +stream-piece-bytes+
          do (write-sequence *big-body* out :start start
                                            :end (min (length *big-body*)
                                                      (+ start +stream-piece-bytes+))))
    (finish-output out)
    nil))

;;; Uploads (bench/uploads.lisp)

(defconstant +upload-piece-bytes+ 65536
  "The size of the pieces /upload reads a body in.")

(defun count-body (stream)
  "Read the body STREAM to its end in pieces of +UPLOAD-PIECE-BYTES+ (one
buffer per request, reused), keeping nothing; the number of octets read."
  (let ((buffer (make-array +upload-piece-bytes+ :element-type '(unsigned-byte 8)))
        (total 0))
    (declare (type fixnum total))
    ;; Until a read returns nothing: READ-SEQUENCE returns a short count
    ;; only at end of file, but a Gray stream need not.
    (loop for n of-type fixnum = (read-sequence buffer stream)
          until (zerop n)
          do (incf total n))
    total))

(hunchentoot:define-easy-handler (upload :uri "/upload") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (princ-to-string (count-body (hunchentoot:raw-post-data :want-stream t))))

(hunchentoot:define-easy-handler (ignore-upload :uri "/ignore") ()
  (setf (hunchentoot:content-type*) "text/plain")
  "ignored")

;;; Errors (bench/attacks.lisp): a handler that signals one, as a bug a
;;; client can reach does.

(hunchentoot:define-easy-handler (fail :uri "/error") ()
  (error "The handler of /error failed, as it always does."))

;;; WebSockets (bench/attacks.lisp).  /ws echoes each message; /feed joins
;;; the feed: a thread that sends every WebSocket on it BENCH_FEED_BYTES
;;; (16 KiB) as one binary message every BENCH_FEED_MS (20 ms), as a chat
;;; or a ticker broadcasts, whether or not the clients read.  Native: GALLOP:
;;; ACCEPT-WEBSOCKET, the feed sending with GALLOP:WS-BROADCAST where Gallop
;;; has it, else GALLOP:WS-SEND to each WebSocket in turn.  Hunchentoot's
;;; kinds (with BENCH_SWITCHED=1): hunchensocket's shape, which this file
;;; reproduces with Hunchentoot alone (hunchensocket is not a Debian
;;; package): the handler answers 101, then PROCESS-REQUEST :AFTER keeps its
;;; thread and reads frames from the request's stream in a loop, with
;;; hunchensocket's limits (a fragment over 65,535 octets or a message over
;;; 1 MiB is closed with 1009) and its SET-TIMEOUTS of 300 s on the
;;; connection's usocket (BENCH_SWITCHED_TIMEOUT: other seconds, or "none"
;;; to leave the server's own); the feed writes each frame to each client's
;;; stream from its thread, under the client's lock, as hunchensocket's
;;; SEND-TEXT-MESSAGE does.

(defparameter *feed-bytes*
  (let ((v (uiop:getenv "BENCH_FEED_BYTES")))
    (if (and v (plusp (length v))) (parse-integer v) 16384))
  "The size of the feed's message.")

(defparameter *feed-ms*
  (let ((v (uiop:getenv "BENCH_FEED_MS")))
    (if (and v (plusp (length v))) (parse-integer v) 20))
  "Milliseconds from one feed message to the next.")

(defparameter *feed-message*
  (make-array *feed-bytes* :element-type '(unsigned-byte 8) :initial-element 120)
  "The feed's message, built once: what the feed sends is the same each time.")

(defvar *feed* '() "The WebSockets (or switched clients) on /feed.")
(defvar *feed-lock* (sb-thread:make-mutex :name "feed"))
(defvar *feed-thread* nil "The feed's thread while anyone is on it.")
(defvar *feed-ticks* 0 "Messages the feed sent to everyone on it so far.")
(defvar *feed-sends* 0 "Messages the feed sent to one WebSocket so far.")
(defvar *feed-errors* 0 "Sends to one WebSocket that failed.")

(defun feed-send (clients)
  "Send the feed's message to CLIENTS once."
  (if (eq *kind* :native)
      (let ((broadcast (find-symbol "WS-BROADCAST" "GALLOP")))
        (if (and broadcast (fboundp broadcast))
            (handler-case (progn (funcall broadcast clients *feed-message*)
                                 (incf *feed-sends* (length clients)))
              (error () (incf *feed-errors*)))
            (dolist (ws clients)
              (handler-case (progn (funcall (gallop-symbol "WS-SEND") ws *feed-message*)
                                   (incf *feed-sends*))
                (error () (incf *feed-errors*))))))
      (dolist (client clients)
        (handler-case (progn (write-switched-frame client 2 *feed-message*)
                             (incf *feed-sends*))
          (error ()
            (incf *feed-errors*)
            (leave-feed client))))))

(defun feed-loop ()
  "Send the feed's message every *FEED-MS* until nobody is on the feed."
  (loop
    (let ((start (get-internal-real-time))
          (clients (sb-thread:with-mutex (*feed-lock*)
                     (or (copy-list *feed*)
                         (progn (setf *feed-thread* nil) (return))))))
      (feed-send clients)
      (incf *feed-ticks*)
      (let ((left (- (/ *feed-ms* 1000)
                     (/ (- (get-internal-real-time) start) internal-time-units-per-second))))
        (when (plusp left) (sleep left))))))

(defun join-feed (client)
  (sb-thread:with-mutex (*feed-lock*)
    (push client *feed*)
    (unless *feed-thread*
      (setf *feed-thread* (sb-thread:make-thread #'feed-loop :name "feed")))))

(defun leave-feed (client)
  (sb-thread:with-mutex (*feed-lock*)
    (setf *feed* (remove client *feed*))))

(defun feed-mode ()
  (cond ((not (eq *kind* :native)) :switched-streams)
        ((let ((broadcast (find-symbol "WS-BROADCAST" "GALLOP")))
           (and broadcast (fboundp broadcast)))
         :ws-broadcast)
        (t :ws-send)))

(defun feed-report ()
  (list :mode (feed-mode) :ticks *feed-ticks* :sends *feed-sends* :errors *feed-errors*
        :clients (sb-thread:with-mutex (*feed-lock*) (length *feed*))))

;;; hunchensocket's shape on Hunchentoot's kinds

(defparameter *switched*
  (equal "1" (uiop:getenv "BENCH_SWITCHED"))
  "True: the Hunchentoot kinds serve /ws and /feed in hunchensocket's shape
\(otherwise their request class and acceptor are Hunchentoot's or Gallop's
own, as the other benchmarks measure them).")

(defparameter *switched-timeout*
  (let ((v (uiop:getenv "BENCH_SWITCHED_TIMEOUT")))
    (cond ((or (null v) (zerop (length v))) 300)
          ((string-equal v "none") nil)
          (t (parse-integer v))))
  "The read and write timeout the switched handler sets on its connection
\(hunchensocket's WEBSOCKET-TIMEOUT, 300 s by default), or NIL for none.")

(defconstant +switched-max-fragment+ 65535
  "hunchensocket's largest frame of a data message.")

(defconstant +switched-max-message+ (1- (* 1024 1024))
  "hunchensocket's largest data message.")

(defvar *switched-socket* nil
  "The usocket PROCESS-CONNECTION was given, for SET-TIMEOUTS.")

(defclass switched-request (hunchentoot:request) ()
  (:documentation "A request whose PROCESS-REQUEST :AFTER may keep its stream."))

(defclass switched-acceptor-mixin () ()
  (:default-initargs :request-class 'switched-request))

(defmethod hunchentoot:process-connection :around ((acceptor switched-acceptor-mixin) socket)
  (let ((*switched-socket* socket))
    (call-next-method)))

(defun acceptor-class (class)
  "CLASS, or with BENCH_SWITCHED a subclass of it with the switched shape
\(made here at run time: Gallop's classes exist only once Gallop is loaded)."
  (if *switched*
      (let ((name (intern (concatenate 'string "SWITCHED-" (symbol-name class))
                          '#:gallop-bench-server)))
        (eval `(defclass ,name (switched-acceptor-mixin ,class) ()))
        name)
      class))

(defun sha1 (octets)
  "The SHA-1 digest of OCTETS (FIPS 180-4), for the handshake's accept key.
Not Gallop's (src/native/websocket-handshake.lisp): the stock Hunchentoot
server, which serves WebSockets with it too, does not load Gallop."
  (let* ((n (length octets))
         (total (* 64 (ceiling (+ n 9) 64)))
         (m (make-array total :element-type '(unsigned-byte 8) :initial-element 0))
         (w (make-array 80))
         (h (list #x67452301 #xEFCDAB89 #x98BADCFE #x10325476 #xC3D2E1F0)))
    (replace m octets)
    (setf (aref m n) #x80)
    (dotimes (i 8)
      (setf (aref m (- total 1 i)) (ldb (byte 8 (* 8 i)) (* 8 n))))
    (flet ((rotl (x k) (logand #xffffffff (logior (ash x k) (ash x (- k 32))))))
      (loop for block from 0 below total by 64
            do (dotimes (i 16)
                 (let ((at (+ block (* 4 i))))
                   (setf (aref w i) (logior (ash (aref m at) 24) (ash (aref m (+ at 1)) 16)
                                            (ash (aref m (+ at 2)) 8) (aref m (+ at 3))))))
               (loop for i from 16 below 80
                     do (setf (aref w i) (rotl (logxor (aref w (- i 3)) (aref w (- i 8))
                                                       (aref w (- i 14)) (aref w (- i 16)))
                                               1)))
               (destructuring-bind (a b c d e) h
                 (dotimes (i 80)
                   (multiple-value-bind (f k)
                       (cond ((< i 20) (values (logior (logand b c) (logand (lognot b) d)) #x5A827999))
                             ((< i 40) (values (logxor b c d) #x6ED9EBA1))
                             ((< i 60) (values (logior (logand b c) (logand b d) (logand c d)) #x8F1BBCDC))
                             (t (values (logxor b c d) #xCA62C1D6)))
                     (let ((next (logand #xffffffff (+ (rotl a 5) f e k (aref w i)))))
                       (setf e d d c c (rotl b 30) b a a next))))
                 (setf h (mapcar (lambda (x y) (logand #xffffffff (+ x y))) h (list a b c d e))))))
    (let ((digest (make-array 20 :element-type '(unsigned-byte 8))))
      (loop for word in h
            for at from 0 by 4
            do (dotimes (i 4)
                 (setf (aref digest (+ at i)) (ldb (byte 8 (- 24 (* 8 i))) word))))
      digest)))

(defun websocket-accept (key)
  (cl-base64:usb8-array-to-base64-string
   (sha1 (map '(vector (unsigned-byte 8)) #'char-code
              (concatenate 'string key "258EAFA5-E914-47DA-95CA-C5AB0DC85B11")))))

(defun switch-or-refuse ()
  "The handler of /ws and /feed on Hunchentoot's kinds: 101 to a WebSocket
handshake (PROCESS-REQUEST :AFTER then takes the stream), else 400."
  (let ((key (hunchentoot:header-in* :sec-websocket-key)))
    (cond ((and *switched* key
                (string-equal "websocket" (or (hunchentoot:header-in* :upgrade) "")))
           (setf (hunchentoot:return-code*) 101
                 (hunchentoot:header-out :upgrade) "websocket"
                 (hunchentoot:header-out :connection) "Upgrade"
                 (hunchentoot:header-out :sec-websocket-accept) (websocket-accept key))
           "")
          (t (setf (hunchentoot:return-code*) 400
                   (hunchentoot:content-type*) "text/plain")
             "WebSocket handshakes only (BENCH_SWITCHED=1 on Hunchentoot's kinds)"))))

(hunchentoot:define-easy-handler (ws :uri "/ws") () (switch-or-refuse))
(hunchentoot:define-easy-handler (feed :uri "/feed") () (switch-or-refuse))

(defclass switched-client ()
  ((stream :initarg :stream :reader switched-client-stream)
   (path :initarg :path :reader switched-client-path)
   (lock :initform (sb-thread:make-mutex :name "client writes") :reader switched-client-lock))
  (:documentation "A WebSocket's client, a CLOS instance as hunchensocket's are."))

(defclass switched-frame ()
  ((opcode :initarg :opcode :reader frame-opcode)
   (fin :initarg :fin :reader frame-fin)
   (length :initarg :length :reader frame-length)
   (mask :initarg :mask :reader frame-mask))
  (:documentation "A frame's head, a CLOS instance made for each frame read,
as hunchensocket's READ-FRAME makes one: so the first frames of many
WebSockets at once meet MAKE-INSTANCE's first call, as theirs do."))

(defun write-switched-frame (client opcode payload)
  "One final, unmasked frame of OPCODE to CLIENT, from any thread."
  (let ((stream (switched-client-stream client))
        (n (length payload)))
    (sb-thread:with-mutex ((switched-client-lock client))
      (write-byte (logior #x80 opcode) stream)
      (cond ((< n 126) (write-byte n stream))
            ((< n 65536) (write-byte 126 stream)
             (write-byte (ldb (byte 8 8) n) stream) (write-byte (ldb (byte 8 0) n) stream))
            (t (write-byte 127 stream)
             (loop for shift from 56 downto 0 by 8 do (write-byte (ldb (byte 8 shift) n) stream))))
      (write-sequence payload stream)
      (force-output stream))))

(define-condition switched-refusal (error)
  ((code :initarg :code :reader refusal-code)
   (reason :initarg :reason :reader refusal-reason)))

(defun read-octets (stream n)
  (let ((octets (make-array n :element-type '(unsigned-byte 8))))
    (unless (= n (read-sequence octets stream))
      (error 'end-of-file :stream stream))
    octets))

(defun read-big-endian (stream n)
  (loop with value = 0 repeat n do (setf value (+ (ash value 8) (read-byte stream))) finally (return value)))

(defgeneric switched-message (path client opcode payload)
  (:documentation "A whole message from CLIENT on PATH: a generic function,
as hunchensocket's TEXT-MESSAGE-RECEIVED is.")
  (:method ((path string) client opcode payload)
    (when (string= path "/ws")
      (write-switched-frame client opcode
                            (if (= opcode 1)
                                (flexi-streams:string-to-octets
                                 (flexi-streams:octets-to-string payload :external-format :utf-8)
                                 :external-format :utf-8)
                                payload)))))

(defun switched-loop (client)
  "Read CLIENT's frames until it closes or breaks a limit."
  (let ((stream (switched-client-stream client))
        (fragments '()) (opcode nil) (total 0))
    (flet ((refuse (code reason) (error 'switched-refusal :code code :reason reason)))
      (loop
        (let* ((b0 (read-byte stream))
               (b1 (read-byte stream))
               (frame (make-instance 'switched-frame
                                     :opcode (ldb (byte 4 0) b0) :fin (logbitp 7 b0)
                                     :length (let ((n (ldb (byte 7 0) b1)))
                                               (case n
                                                 (126 (read-big-endian stream 2))
                                                 (127 (read-big-endian stream 8))
                                                 (t n)))
                                     :mask (and (logbitp 7 b1) (read-octets stream 4))))
               (op (frame-opcode frame))
               (n (frame-length frame))
               (mask (frame-mask frame)))
          (cond ((>= op 8)
                 (when (> n 125) (refuse 1002 "Control frame is too large")))
                ;; A data frame's limits, before its payload is read.
                ((> n +switched-max-fragment+) (refuse 1009 "Message fragment too big"))
                ((> (+ total n) +switched-max-message+) (refuse 1009 "Total message too big")))
          (let ((payload (read-octets stream n)))
            (when mask
              (dotimes (i n) (setf (aref payload i) (logxor (aref payload i) (aref mask (mod i 4))))))
            (case op
              (8 (write-switched-frame client 8 payload) (return))
              (9 (write-switched-frame client 10 payload))
              (10)
              (t (when (/= op 0) (setf opcode op))
               (push payload fragments)
               (incf total n)
               (when (frame-fin frame)
                 (let ((message (apply #'concatenate '(vector (unsigned-byte 8))
                                       (reverse fragments))))
                   (setf fragments '() total 0)
                   (switched-message (switched-client-path client) client opcode
                                     (coerce message '(simple-array (unsigned-byte 8) (*))))))))))))))

(defmethod hunchentoot:process-request :after ((request switched-request))
  (when (eql 101 (hunchentoot:return-code*))
    (let* ((stream (hunchentoot::content-stream request))
           (path (hunchentoot:script-name request))
           (client (make-instance 'switched-client :stream stream :path path)))
      (force-output stream)
      (when *switched-timeout*
        (hunchentoot::set-timeouts *switched-socket* *switched-timeout* *switched-timeout*))
      (when (string= path "/feed")
        (join-feed client))
      (unwind-protect
           (handler-case (switched-loop client)
             (switched-refusal (refusal)
               (ignore-errors
                (let ((reason (map '(vector (unsigned-byte 8)) #'char-code (refusal-reason refusal))))
                  (write-switched-frame client 8
                                        (concatenate '(vector (unsigned-byte 8))
                                                     (vector (ldb (byte 8 8) (refusal-code refusal))
                                                             (ldb (byte 8 0) (refusal-code refusal)))
                                                     reason)))))
             (error () nil))
        (leave-feed client)))))

(defun query-parameter (query name)
  "The value of NAME in the query string QUERY (no decoding: the benchmark's
names are plain)."
  (when query
    (let ((prefix (concatenate 'string name "=")))
      (loop for part in (uiop:split-string query :separator "&")
            when (uiop:string-prefix-p prefix part)
              return (subseq part (length prefix))))))

(defun native-app (env)
  "The native counterpart of /yo, /static, /big, /stream, /upload and /ignore; and /later,
answered \"Hey!\" *LATER-SECONDS* after the request by a timer
\(GALLOP:AFTER), with no thread waiting: cl-async's seed test."
  (let ((path (getf env :path-info)))
    (cond ((string= path "/later")
           (lambda (responder)
             (funcall (gallop-symbol "AFTER") *later-seconds*
                      (lambda ()
                        (funcall responder '(200 (:content-type "text/plain") ("Hey!")))))))
          ((string= path "/yo")
           (when (plusp *handler-sleep-seconds*)
             (sleep *handler-sleep-seconds*))
           ;; The same answer as /yo, built the way a native app would:
           ;; without FORMAT, whose directive interpreter costs more than
           ;; the rest of this app.
           (let ((name (query-parameter (getf env :query-string) "name")))
             (list 200 '(:content-type "text/plain")
                   (list (if name (concatenate 'string "Hey " name "!") "Hey!")))))
          ((string= path "/static")
           (list 200 '(:content-type "text/plain") *static-file*))
          ((string= path "/big")
           (list 200 '(:content-type "application/octet-stream") *big-body*))
          ((string= path "/stream")
           (lambda (responder)
             (let ((writer (funcall responder
                                    (list 200 (list :content-type "application/octet-stream"
                                                    :content-length (length *big-body*))))))
               (loop for start from 0 below (length *big-body*) by +stream-piece-bytes+
                     do (funcall writer (subseq *big-body* start
                                                (min (length *big-body*)
                                                     (+ start +stream-piece-bytes+)))))
               (funcall writer nil :close t))))
          ((string= path "/upload")
           (list 200 '(:content-type "text/plain")
                 (list (princ-to-string (count-body (getf env :raw-body))))))
          ((string= path "/ignore")
           '(200 (:content-type "text/plain") ("ignored")))
          ((string= path "/error")
           (error "The app failed at /error, as it always does."))
          ((and (string= path "/ws") (funcall (gallop-symbol "WEBSOCKET-REQUEST-P") env))
           (funcall (gallop-symbol "ACCEPT-WEBSOCKET") env
                    :on-message (lambda (ws message)
                                  (funcall (gallop-symbol "WS-SEND") ws message))))
          ((and (string= path "/feed") (funcall (gallop-symbol "WEBSOCKET-REQUEST-P") env))
           (funcall (gallop-symbol "ACCEPT-WEBSOCKET") env
                    :on-open #'join-feed
                    :on-close (lambda (ws code reason)
                                (declare (ignore code reason))
                                (leave-feed ws))))
          (t
           '(404 (:content-type "text/plain") ("Not Found"))))))

(defun gallop-symbol (name)
  (or (find-symbol name "GALLOP") (die "GALLOP:~A not found" name)))

(defparameter *message-log*
  (and (uiop:getenv "BENCH_MESSAGE_LOG")
       (string/= (uiop:getenv "BENCH_MESSAGE_LOG") "0")
       *error-output*)
  "Where errors are logged (standard error), or NIL for nowhere.")

(defparameter *log-args*
  (list :access-log-destination nil
        :message-log-destination *message-log*))

(defvar *taskmaster* nil)

(defparameter *idle-timeout*
  (let ((v (uiop:getenv "BENCH_IDLE_TIMEOUT")))
    (and v (plusp (length v)) (parse-integer v)))
  "Seconds Gallop keeps an idle keep-alive connection (default: its own, the
read timeout, 20 s).  Holding ~19,000 idle connections takes longer than 20 s
to set up, so that run raises it.")

(defparameter *thread-idle-timeout*
  (let ((v (uiop:getenv "BENCH_THREAD_IDLE_TIMEOUT")))
    (and v (plusp (length v)) (parse-integer v)))
  "Seconds an idle worker beyond the standby count stays in Gallop's pool
(default: Gallop's own, 10 s).")

(defparameter *timeout*
  (let ((v (uiop:getenv "BENCH_TIMEOUT")))
    (and v (plusp (length v)) (parse-integer v)))
  "Seconds for the acceptor's read and write timeouts, and so for Gallop's
header and idle timeouts (default: 20 s).")

(defparameter *max-head-bytes*
  (let ((v (uiop:getenv "BENCH_MAX_HEAD_BYTES")))
    (and v (plusp (length v)) (parse-integer v)))
  "Gallop's :MAX-HEAD-BYTES (default: its own, 1 MiB).")

(defparameter *extra-options*
  (let ((v (uiop:getenv "BENCH_GALLOP_OPTIONS")))
    (and v (plusp (length v))
         (let ((*read-eval* nil) (*package* (find-package :keyword)))
           (read-from-string v))))
  "More settings for Gallop, a property list read from BENCH_GALLOP_OPTIONS
\(e.g. \"(:max-thread-count 2 :standby-thread-count 2)\"), for experiments.")

(let ((v (uiop:getenv "GALLOP_EPOLL_SETS")))
  ;; The number of epoll sets (worker groups) Gallop's pool starts with,
  ;; instead of one per CPU: for measuring what the groups bring.  (Read at
  ;; run time: the stock server does not load Gallop.)
  ;; "cpus": one per usable CPU.
  (when (and v (plusp (length v)) (find-package "GALLOP.CORE"))
    (setf (symbol-value (find-symbol "*GROUP-COUNT*" "GALLOP.CORE"))
          (if (string-equal v "cpus") nil (parse-integer v)))))

(defun gallop-options ()
  "The pool and keep-alive timeouts and the head limit set from the
environment, as initargs of GALLOP:TASKMASTER and keywords of GALLOP:START
alike, then BENCH_GALLOP_OPTIONS."
  (append *extra-options*
          (and *idle-timeout* (list :idle-timeout *idle-timeout*))
          (and *thread-idle-timeout* (list :thread-idle-timeout *thread-idle-timeout*))
          (and *max-head-bytes* (list :max-head-bytes *max-head-bytes*))))

(defun acceptor-timeout-args ()
  "The read and write timeouts of a Hunchentoot acceptor, from BENCH_TIMEOUT."
  (and *timeout* (list :read-timeout *timeout* :write-timeout *timeout*)))

(defun native-timeout-args ()
  "GALLOP:START's timeouts from BENCH_TIMEOUT (after GALLOP-OPTIONS, whose
:IDLE-TIMEOUT comes first and so wins)."
  (and *timeout* (list :read-timeout *timeout* :write-timeout *timeout*
                       :header-timeout *timeout* :idle-timeout *timeout*)))

(defparameter *tls*
  (let ((cert (uiop:getenv "BENCH_TLS_CERT"))
        (key (uiop:getenv "BENCH_TLS_KEY")))
    (and cert (plusp (length cert)) (list cert key)))
  "The certificate and key files to answer HTTPS with, or NIL.")

(defun tls-initargs ()
  "A Hunchentoot SSL acceptor's certificate initargs, from *TLS*."
  (list :ssl-certificate-file (first *tls*) :ssl-privatekey-file (second *tls*)))

(defparameter *reuse-port*
  (equal "1" (uiop:getenv "BENCH_REUSE_PORT"))
  "True: Gallop's kinds bind with :REUSE-PORT.")

(defun gallop-taskmaster ()
  (apply #'make-instance (gallop-symbol "TASKMASTER") (gallop-options)))

(defparameter *acceptor*
  (case *kind*
    (:stock
     (apply #'make-instance (acceptor-class (if *tls* 'hunchentoot:easy-ssl-acceptor
                                                'hunchentoot:easy-acceptor))
            :address "127.0.0.1" :port *port*
            (append (and *tls* (tls-initargs)) (acceptor-timeout-args) *log-args*)))
    (:gallop
     (apply #'make-instance (acceptor-class (gallop-symbol (if *tls* "EASY-SSL-ACCEPTOR"
                                                                "EASY-ACCEPTOR")))
            :address "127.0.0.1" :port *port* :taskmaster (gallop-taskmaster)
            :reuse-port *reuse-port*
            (append (and *tls* (tls-initargs)) (acceptor-timeout-args) *log-args*)))
    (:gallop-tm
     (setf *taskmaster* (gallop-taskmaster))
     (apply #'make-instance (acceptor-class (if *tls* 'hunchentoot:easy-ssl-acceptor
                                                'hunchentoot:easy-acceptor))
            :address "127.0.0.1" :port *port* :taskmaster *taskmaster*
            (append (and *tls* (tls-initargs)) (acceptor-timeout-args) *log-args*)))))

(defvar *native-server* nil)

(defun stats ()
  (ecase *kind*
    (:native (funcall (gallop-symbol "STATS") *native-server*))
    (:stock (list :threads (hunchentoot:taskmaster-thread-count
                            (hunchentoot::acceptor-taskmaster *acceptor*))))
    (:gallop (funcall (gallop-symbol "STATS") *acceptor*))
    (:gallop-tm (funcall (gallop-symbol "STATS") *taskmaster*))))

(defun server-settings ()
  "Every Gallop setting of this server, as a property list: its default
\(GALLOP.CORE::+SETTINGS+) unless BENCH_GALLOP_OPTIONS gives it; stock
Hunchentoot's thread limit and read timeout for stock."
  (if (eq *kind* :stock)
      (list :max-thread-count (hunchentoot:taskmaster-max-thread-count
                               (hunchentoot::acceptor-taskmaster *acceptor*))
            :read-timeout (hunchentoot:acceptor-read-timeout *acceptor*))
      (let ((table (find-symbol "+SETTINGS+" "GALLOP.CORE")))
        (loop for (name default) in (and table (boundp table) (symbol-value table))
              for key = (intern (symbol-name name) :keyword)
              for given = (getf *extra-options* key '%none)
              append (list key (if (eq given '%none) (ignore-errors (eval default)) given))))))

(defun reply (control &rest args)
  (let ((*print-pretty* nil))
    (format *protocol* "~?~%" control args))
  (finish-output *protocol*))

(handler-case (if (eq *kind* :native)
                  (setf *native-server*
                        (apply (gallop-symbol "START") #'native-app
                               :address "127.0.0.1" :port *port* :log *message-log*
                               :reuse-port *reuse-port*
                               (append (gallop-options) (native-timeout-args)
                                       (let ((path (uiop:getenv "BENCH_ACCESS_LOG")))
                                         (and path (plusp (length path))
                                              (list :access-log path
                                                    :access-log-format
                                                    (if (equal (uiop:getenv "BENCH_ACCESS_LOG_FORMAT")
                                                               "json")
                                                        :json :combined))))
                                       (and *tls* (list :ssl-certificate-file (first *tls*)
                                                        :ssl-privatekey-file (second *tls*))))))
                  (funcall (find-symbol "START" "HUNCHENTOOT") *acceptor*))
  (error (e) (die "cannot start ~(~A~) on port ~D: ~A" *kind* *port* e)))

(when *beside-port*
  (handler-case (hunchentoot:start (apply #'make-instance (gallop-symbol "EASY-ACCEPTOR")
                                         :address "127.0.0.1" :port *beside-port* *log-args*))
    (error (e) (die "cannot start Gallop beside on port ~D: ~A" *beside-port* e))))

(unless (eq *kind* :stock)
  (funcall (gallop-symbol "STOP-ON-SIGTERM")))

(reply "READY ~D" (sb-unix:unix-getpid))

(handler-case
    (loop for line = (read-line *standard-input* nil)
          while line
          do (let ((command (string-trim " " line)))
               (cond ((string= command "stats")
                      (reply "STATS ~S" (ignore-errors (stats))))
                     ((string= command "gc")
                      (sb-ext:gc :full t)
                      (reply "GC ~D" (sb-kernel:dynamic-usage)))
                     ((string= command "feed")
                      (reply "FEED ~S" (feed-report)))
                     ((string= command "settings")
                      (reply "SETTINGS ~S" (ignore-errors (server-settings))))
                     ((string= command "heap")
                      (reply "HEAP ~D ~D" (sb-kernel:dynamic-usage)
                             (sb-ext:dynamic-space-size)))
                     ((string= command "gc-stats")
                      (reply "GC-STATS ~D ~D" (round (* 1000 sb-ext:*gc-run-time*)
                                                     internal-time-units-per-second)
                             (sb-ext:get-bytes-consed)))
                     ((string= command "perf-map")
                      ;; perf(1) names Lisp functions from /tmp/perf-PID.map.
                      (require :sb-posix)
                      (load (merge-pathnames "perf-map.lisp" *load-truename*))
                      (reply "PERF-MAP ~D" (funcall (intern "WRITE-PERF-MAP" *package*))))
                     ((string= command "quit")
                      (return)))))
  (sb-sys:interactive-interrupt () nil)
  (error (e) (format *error-output* "~&bench server: control loop: ~A~%" e)))

;; No graceful stop: the harness measures serving, not shutting down, and a
;; stock Hunchentoot with busy threads could take a while to stop.
(sb-ext:exit :code 0 :abort t)
