;;;; connection.lisp -- one client connection: a binary Gray stream over a
;;;; non-blocking socket, with the state machine that lets it live in epoll
;;;; between requests.
;;;;
;;;; States (slot STATE, changed with compare-and-swap where two threads race):
;;;;   :PARKED    waiting in its group's epoll set (registered once,
;;;;              edge-triggered); nobody runs on it.  The housekeeper may
;;;;              close it once DEADLINE passed.
;;;;   :ACTIVE    exactly one worker owns it (it won the CAS :PARKED -> :ACTIVE),
;;;;              or a thread that will answer a suspended request.
;;;;   :DIRTY     still owned as :ACTIVE, but an event came meanwhile (input
;;;;              arrived); the owner's PARK then fails and it reads again.
;;;;              Only the owner leaves :ACTIVE or :DIRTY; an event only moves
;;;;              :PARKED -> :ACTIVE (taking ownership) or :ACTIVE -> :DIRTY.
;;;;   :DETACHED  the request handler kept the stream (Hunchentoot's
;;;;              DETACH-SOCKET); its owner closes it with CLOSE.
;;;;   :DRAINING  an error response was sent and the write side shut; the
;;;;              housekeeper reads and discards until EOF or DEADLINE, then
;;;;              closes, so the client reads the response instead of a reset.
;;;;   :CLOSED    the fd is closed and TABLE no longer holds the connection.
;;;;
;;;; While :ACTIVE, reads block the worker with poll(2) bounded by the
;;;; engine's read timeout; writes do not wait for the client: what the socket
;;;; does not take stays in the connection's output queue, and after the
;;;; answer the connection parks (:PARKED, for EPOLLOUT) until it is sent (see
;;;; Output below).
;;;; Between requests the layer above calls CONNECTION-MARK-BOUNDARY; the next
;;;; read then answers end-of-file unless a complete request head is already
;;;; buffered, and records that the connection should be parked, so the
;;;; request loop of the layer above ends and the worker returns to the pool
;;;; (the stream's input methods and CLOSE: stream.lisp).

(in-package #:gallop.core)

(define-condition connection-error (stream-error)
  ((errno :initarg :errno :initform 0 :reader connection-error-errno)
   (operation :initarg :operation :initform "I/O" :reader connection-error-operation))
  (:report (lambda (c s)
             (let ((errno (connection-error-errno c)))
               (format s "~A failed on ~A: ~A"
                       (connection-error-operation c) (stream-error-stream c)
                       (case errno
                         (0 "the client closed the connection")
                         (32 "the client closed the connection (broken pipe)")
                         (104 "the client reset the connection")
                         (t (format nil "errno ~D" errno)))))))
  (:documentation "A read or write on a connection failed: mostly the client
went away (end of file, reset, broken pipe)."))

(define-condition connection-timeout-error (connection-error)
  ()
  (:report (lambda (c s)
             (format s "~A timed out on ~A"
                     (connection-error-operation c) (stream-error-stream c))))
  (:documentation "A read or write on a connection made no progress in time."))

(define-condition handler-timeout (serious-condition)
  ((seconds :initarg :seconds :initform nil :reader handler-timeout-seconds))
  (:report (lambda (c s)
             (if (handler-timeout-seconds c)
                 (format s "The request handler ran past its deadline of ~A s and was interrupted."
                         (handler-timeout-seconds c))
                 (format s "The request handler was interrupted: the server is stopping."))))
  (:documentation "Signalled in a worker whose request handler ran past the
engine's HANDLER-TIMEOUT (SECONDS), or still ran when a stop gave up waiting
for it (SECONDS NIL: see ENGINE-STOP).  It is a SERIOUS-CONDITION, not an
ERROR, so that handlers that catch every ERROR (IGNORE-ERRORS, HANDLER-CASE
on ERROR) still unwind; their UNWIND-PROTECT cleanups run.  The connection
is closed after the request."))

;;; What a connection that switched protocols holds in its UPGRADE slot
;;; (upgrade.lisp).

(defstruct (upgrade (:constructor make-upgrade (on-read on-close idle-ms send-limit))
                    (:copier nil) (:predicate nil))
  "What a connection that switched protocols does with what it receives."
  (on-read nil :type (or null function))  ; (OCTETS START END), on a worker
  (on-close nil :type (or null function)) ; (), once, when the connection ends
  (idle-ms 0 :type fixnum)                ; 0: no idle timeout
  (send-limit 0 :type fixnum)
  (mailbox nil :type list)                ; segments from other threads, newest first
  (mailbox-bytes 0 :type sb-ext:word)
  (reader nil)                            ; the thread running ON-READ
  (closing nil :type (member nil :close :abort))
  (last-input 0 :type fixnum)             ; NOW-MS when the client last sent
  (charged 0 :type sb-ext:word)           ; octets counted in the body budget, as :MESSAGES
  (inflated 0 :type sb-ext:word)          ; and as :INFLATE (account.lisp)
  (on-shed nil :type (or null function))  ; (), how the layer above closes it when shed
  (on-limit nil :type (or null function)) ; (), how the layer above closes a client past its send limit
  (last-words nil)                        ; octets sent after a cut (CONNECTION-CUT-UPGRADED), then T
  (ended nil)                             ; ON-CLOSE is called (or due)
  (entered nil))                          ; the handler returned: read from epoll

(defmethod print-object ((u upgrade) stream)
  (print-unreadable-object (u stream :type t :identity t)))

(defclass connection (sb-gray:fundamental-binary-input-stream
                      sb-gray:fundamental-binary-output-stream)
  ((fd :initarg :fd :type fixnum)
   (engine :initarg :engine)
   (group :initarg :group
          :documentation "The pool's group (pool.lisp) in whose epoll set this connection
waits: chosen when it is made, kept to the end.")
   (tally :initarg :tally
          :documentation "The stripe of the engine's request counters (engine.lisp,
TALLY) this connection's requests count in: its group's.")
   (token :initarg :token :type (unsigned-byte 64))
   (state :initform :parked)
   (inbuf :initform nil :type (or null octets))
   (in-start :initform 0 :type fixnum)
   (in-end :initform 0 :type fixnum)
   (scan :initform 0 :type fixnum
         :documentation "Where the search for the end of the request head resumes.")
   (outbuf :initform nil :type (or null octets))
   (out-fill :initform 0 :type fixnum)
   (deadline :initform 0 :type fixnum)
   (wheel-tick :initform -1 :type fixnum
               :documentation "The tick of this connection's entry in the timing wheel, or -1.")
   (wheel-entry :initform nil
                :documentation "That entry, (CONNECTION . TICK), or NIL.")
   (head-started :initform nil
                 :documentation "When the first byte of a still-incomplete head arrived.")
   (fresh :initform t :documentation "True until the first request is served.")
   (queued :initform nil
           :documentation "True while C counts in its engine's PENDING: its
request was here and no worker was free when it was handed to the workers,
and none has served it yet (HAND-TO-WORKERS).")
   (gone :initform nil
         :documentation "True once a send failed because the client went away.")
   (peer-closed :initform nil
                :documentation "True once an event said the client half-closed, or a TLS
read found the end of the TLS stream behind its octets (SSL-RECV).")
   (drained :initform nil
            :documentation "True when the last read from the socket returned less
than it asked for: the socket had nothing more then, so any later input
raises an event.")
   (waiting-turn :initform nil
                 :documentation "True while C is queued for a worker with its next
pipelined request buffered (YIELD-TURN), until a worker serves it.")
   (raw :initarg :raw :initform nil
        :documentation "Dispatch on the first bytes instead of on a complete head (TLS
through a library above the engine, see tls.lisp).")
   (tls :initarg :tls :initform 0 :type fixnum
        :documentation "0 on a plain socket.  On the engine's own TLS (openssl.lisp): the
address of the connection's SSL object, or -1 until a worker makes it on the
first read.")
   (request :initform (make-request) :type request
            :documentation "The request being served: its head as PARSE-HEAD read it
and the state of reading its body (request.lisp).")
   (boundary :initform nil)
   (stream-closed :initform nil
                  :documentation "True once the layer above closed C's stream for the
request being served (CLOSE): no more reads or writes through it.")
   (sent :initform 0 :type fixnum
         :documentation "Bytes of the current response sent so far (0: none).")
   (handler-thread :initform nil
                   :documentation "The worker running the handler on this connection, or NIL.")
   (handler-serial :initform 0 :type fixnum
                   :documentation "Counts handler runs on this connection, so that a
deadline interrupt meant for one request never hits the next.")
   (interrupted :initform nil
                :documentation "True once the handler was interrupted: close after it.")
   (source :initform nil
           :documentation "For the plaintext side of a TLS connection (tls.lisp): the
TLS stream it reads and writes instead of its fd.")
   (budgeted :initform 0 :type fixnum
             :documentation "Octets of the engine's head budget this connection holds.")
   (blank-lines :initform 0 :type fixnum
                :documentation "Empty lines skipped since the last request (SCAN-HEAD).")
   (line-checked :initform nil
                 :documentation "True once CHECK-PARTIAL-HEAD checked the request
line of the head being read (until BEGIN-MESSAGE).")
   (detaching :initform nil
              :documentation "True once the layer above detached the stream (see
CONNECTION-DETACH): its reads pass through and know no request boundary.
T while the worker still holds C; then :LET-GO, or :CLOSED when the stream
was closed first (LET-GO-DETACHED decides, with CLOSE, who closes C).")
   (remote-port :initarg :remote-port :initform 0)
   (user-data :initarg :user-data :initform nil
              :documentation "What the layer above keeps with this connection.")
   (unsent :initform nil
           :documentation "Output the socket did not take yet: a list of SEGMENTs,
oldest first.  Only the connection's owner touches it.")
   (body-given :initform nil
               :documentation "True when the layer above gave up the octets of this
answer's body (see CONNECTION-GIVE-BODY).")
   (after-write :initform nil
                :documentation "What the engine does once UNSENT is sent: :SERVE (the
next request) or :CLOSE.")
   (suspended :initform nil
              :documentation "True while a request on C is answered from another thread
\(CONNECTION-SUSPEND to CONNECTION-RESUME).")
   ;; The slots above may be read or written for any request (on either
   ;; front end); those below only now and then (TLS, a response the socket
   ;; did not take whole, a request answered later, closing).  Kept apart so
   ;; that a request's work touches fewer of the connection's cache lines:
   ;; with hundreds of connections taking turns, each one's state is mostly
   ;; not in the cache.
   (tls-phase :initform :handshake :type (member :handshake :open :over)
              :documentation "On TLS: :HANDSHAKE until it is done, then :OPEN; :OVER once
close_notify was sent or the TLS stream failed (nothing more is sent).")
   (cipher :initform nil
           :documentation "For the plaintext side of a TLS connection: the connection
carrying the ciphertext.")
   (ssl-lock :initform nil
             :documentation "On the engine's TLS once C is detached (CONNECTION-DETACH):
the mutex every call on C's SSL object holds, since the stream's owner may
read it while other threads write to it (WITH-SSL).  NIL while one thread
at a time owns C.")
   (pending :initform nil
            :documentation "On a plaintext connection: a function, true when the TLS
stream holds decrypted octets not read yet.")
   (read-deadline :initform 0 :type fixnum
                  :documentation "When non-zero, the time (NOW-MS) by which reads must be done:
the header timeout of a head read through TLS (tls.lisp).")
   (timed-out :initform nil
              :documentation "True once a read or write on C timed out (reset by the
plaintext side of TLS, which reads it).")
   (remote-address :initarg :remote-address :initform nil)
   (local-address :initform nil)
   (local-port :initform nil)
   (owner-stream :initform nil
                 :documentation "The plaintext connection reading TLS over this one, if any.")
   (close-hook :initarg :close-hook :initform nil
               :documentation "Called instead of close(2) to release the fd.")
   (unsent-tail :initform nil :documentation "The last cons of UNSENT.")
   (unsent-bytes :initform 0 :type fixnum :documentation "Octets in UNSENT.")
   (out-progress :initform 0 :type fixnum
                 :documentation "When (NOW-MS) the socket last took output from UNSENT,
or UNSENT was started: the write timeout counts from there.")
   (out-since :initform 0 :type fixnum
              :documentation "When (NOW-MS) the current period of the minimum data rate
of the client's reading began: when UNSENT was started, or the client last
read a period's quota (OUTPUT-RATE-DEADLINE).")
   (out-drained :initform 0 :type fixnum
                :documentation "Octets the socket took from UNSENT since OUT-SINCE.")
   (out-acked :initform 0 :type fixnum
              :documentation "The client's TCP acknowledgements (TCP-BYTES-ACKED) when
last looked at, for CLIENT-READ-A-PERIOD-P.")
   (out-registered :initform nil
                   :documentation "True once C's epoll registration includes EPOLLOUT.")
   (abandoned :initform nil
              :documentation "True once the client of a SUSPENDED request went away
before the answer, and C was closed (ABANDON).")
   (switched :initform nil
             :documentation "T once C switched protocols under a handler that keeps
its thread (CONNECTION-SWITCH); :COUNTED once counted for it before
\(CONNECTION-MAY-SWITCH-P).")
   (timeout-stream :initform nil
                   :documentation "For a switched C: an fd-stream whose timeout, once set,
is its reads' (see CONNECTION-SWITCH).")
   (upgrade :initform nil
            :documentation "Once a handler switched protocols on C (CONNECTION-UPGRADE):
what C does with what it receives, and what other threads send on it.")
   (out-parked :initform nil
               :documentation "While SUSPENDED: true while the engine, not the answering
thread, owns C (its worker has not let go yet, or C waits in epoll for its
unsent output to drain); see CONNECTION-ACQUIRE.")
   (paused :initform nil
           :documentation "True while C, upgraded, is left unread by the overload
manager's first action (PAUSE-UPGRADED-P), until the level is back to 0.")
   (shed :initform nil
         :documentation "True once the overload manager chose to close C while a
worker owned it (SHED-CONNECTION): its next queued write fails.")
   (stop-cut :initform nil
             :documentation "NIL until a stop cuts the handler running on C (INTERRUPT-HANDLER
with no deadline: the stop's timeout ran out, or a hard stop): then :CUT,
and :REPORTED once its log line was made (STOP-CUT-MESSAGE).  Never reset:
C closes after that request."))
  (:documentation "A client connection, and the binary stream the layers above
read requests from and write responses to."))

;;; Slot access.  The hot path reads and writes these slots millions of times
;;; a second; SLOT-VALUE and PCL's accessors dispatch through caches on each
;;; call.  CONNECTION is never subclassed, so each slot's location is fixed
;;; once the class is finalized: CONN-SLOT reads it directly.

(eval-when (:compile-toplevel :load-toplevel :execute)
  (defparameter *connection-slot-types*
    '((fd . fixnum) (tls . fixnum) (in-start . fixnum) (in-end . fixnum) (scan . fixnum)
      (out-fill . fixnum) (deadline . fixnum) (wheel-tick . fixnum)
      (sent . fixnum) (handler-serial . fixnum)
      (budgeted . fixnum) (read-deadline . fixnum) (blank-lines . fixnum)
      (unsent-bytes . fixnum) (out-progress . fixnum) (out-since . fixnum)
      (out-drained . fixnum) (out-acked . fixnum)
      (inbuf . (or null octets)) (outbuf . (or null octets)) (request . request))
    "Declared types of CONNECTION's typed slots, for CONN-SLOT."))

(defun connection-slot-location (name)
  (let ((class (find-class 'connection)))
    (unless (sb-mop:class-finalized-p class)
      (sb-mop:finalize-inheritance class))
    (sb-mop:slot-definition-location
     (or (find name (sb-mop:class-slots class) :key #'sb-mop:slot-definition-name)
         (error "CONNECTION has no slot ~S" name)))))

(defmacro %conn-slot (c name)
  "The place of slot NAME of the connection C, untyped (for COMPARE-AND-SWAP)."
  `(sb-mop:standard-instance-access ,c (load-time-value (connection-slot-location ',name) t)))

(eval-when (:compile-toplevel :load-toplevel :execute)
  (defun check-connection-slot-name (name)
    "Signal an error when NAME is a field of the REQUEST record (request.lisp)
rather than a slot of CONNECTION: the request's own accessor names it."
    (when (request-field-name-p name)
      (error "~S is a field of the connection's REQUEST record, not a slot of ~
              CONNECTION: use ~S on (CONNECTION-REQUEST C), or WITH-REQUEST-SLOTS."
             name (request-field-accessor name)))
    name))

(defmacro conn-slot (c name)
  "The place of slot NAME of the connection C (never a field of the request it
serves: see CONNECTION-REQUEST)."
  (check-connection-slot-name name)
  (let ((type (cdr (assoc name *connection-slot-types*))))
    (if type
        `(the ,type (%conn-slot ,c ,name))
        `(%conn-slot ,c ,name))))

(declaim (inline connection-request))
(defun connection-request (c)
  "The record of the request C serves (request.lisp)."
  (conn-slot c request))

(defmacro with-connection-slots ((&rest names) c &body body)
  "WITH-SLOTS for a connection, through CONN-SLOT: slots of the connection
only (the request's fields: WITH-REQUEST-SLOTS)."
  (mapc #'check-connection-slot-name names)
  (let ((var (gensym "CONNECTION")))
    `(let ((,var ,c))
       (declare (ignorable ,var))
       (symbol-macrolet ,(loop for name in names collect `(,name (conn-slot ,var ,name)))
         ,@body))))

(declaim (inline connection-fd connection-engine connection-token connection-state
                 (setf connection-state) connection-deadline (setf connection-deadline)
                 connection-wheel-tick connection-remote-address connection-remote-port
                 connection-user-data (setf connection-user-data) connection-tally
                 connection-owner-stream (setf connection-owner-stream)))
(defun connection-fd (c) (conn-slot c fd))
(defun connection-engine (c) (conn-slot c engine))
(defun connection-group (c) (conn-slot c group))
(defun connection-tally (c) (conn-slot c tally))
(defun connection-token (c) (conn-slot c token))
(defun connection-state (c) (conn-slot c state))
(defun (setf connection-state) (value c) (setf (conn-slot c state) value))
(defun connection-deadline (c) (conn-slot c deadline))
(defun (setf connection-deadline) (value c) (setf (conn-slot c deadline) value))
(defun connection-wheel-tick (c) (conn-slot c wheel-tick))
(defun connection-remote-address (c) (conn-slot c remote-address))
(defun connection-remote-port (c) (conn-slot c remote-port))
(defun connection-user-data (c)
  "What the layer above keeps with this connection."
  (conn-slot c user-data))
(defun (setf connection-user-data) (value c) (setf (conn-slot c user-data) value))
(defun connection-owner-stream (c)
  "A stream wrapping this one (TLS), if any."
  (conn-slot c owner-stream))
(defun (setf connection-owner-stream) (value c) (setf (conn-slot c owner-stream) value))

(declaim (inline begin-in-flight))
(defun begin-in-flight (c)
  "One request more in flight on C (in its connection's stripe)."
  (sb-ext:atomic-incf (tally-in-flight (connection-tally c))))

(defun end-in-flight (c)
  "One request of C less in flight; wake a soft stop waiting for the last one."
  (let ((engine (connection-engine c)))
    (sb-ext:atomic-decf (tally-in-flight (connection-tally c)))
    (unless (engine-running-p engine)
      ;; Stopping: the waiter looks at the sum again.
      (sb-thread:with-mutex ((engine-lock engine))
        (sb-thread:condition-broadcast (engine-idle-queue engine))))))

(defmethod print-object ((c connection) stream)
  (print-unreadable-object (c stream :type t :identity t)
    (format stream "fd ~D ~(~A~)" (connection-fd c) (connection-state c))))

;;; The metrics' counts (engine.lisp, TALLY-COUNTS), in C's stripe.

(declaim (inline tally-add))
(defun tally-add (c cell n)
  "Add N to CELL of the counts of C's stripe (+BYTES-IN-CELL+ ...)."
  (declare (type fixnum n))
  (sb-ext:atomic-incf (aref (tally-counts (the tally (connection-tally c))) cell) n))

(defmacro counting-octets ((c cell) form)
  "FORM's values (N ERRNO), N (when positive) added to CELL of C's stripe."
  (let ((n (gensym "N")) (errno (gensym "ERRNO")))
    `(multiple-value-bind (,n ,errno) ,form
       (declare (type fixnum ,n))
       (when (plusp ,n)
         (tally-add ,c ,cell ,n))
       (values ,n ,errno))))

(defun connection-count-answer (c status)
  "Called by a layer above where it begins the answer STATUS to the request
C serves, once per request, and by the engine for its own answers: count it
for the metrics, by the request's method (\"other\" before its head was
checked) and STATUS's class, and its duration, from the head being checked
to now (none when it never was: see COUNT-ANSWER-IN).
Interim answers (100 Continue) are not counted; a 101 is.
  Both ends of a duration are read on the precise clock (NOW-US): the
coarse one moves a kernel tick (1 to 10 ms) at a time, as long as the
durations the histogram tells apart (doc/design.md, \"Durations read the
precise clock\")."
  (let* ((request (conn-slot c request))
         (begun (request-begun request)))
    (declare (type fixnum begun))
    (setf (request-answered request) t)
    (count-answer-in (connection-tally c)
                     (and (plusp begun) (request-method request))
                     status
                     (and (plusp begun) (- (the fixnum (now-us)) begun)))))

(defconstant +logged-line-octets+ 8192
  "The most octets of a refused request's line given to the layer above's
log: nginx logs at most what its header buffer holds, 8 KiB by default, and
a client that sends a longer line costs the log no more than that.")

(defun received-line-end (c)
  "The end of the request line (or of what came of it) in C's input from
IN-START: its first CR or LF, else IN-END, at most +LOGGED-LINE-OCTETS+
on; NIL when C holds no input."
  (with-connection-slots (inbuf in-start in-end) c
    (when (and inbuf (< in-start in-end))
      (let ((buffer inbuf)
            (end (min in-end (+ in-start +logged-line-octets+))))
        (declare (type octets buffer) (type fixnum end))
        (loop for i of-type fixnum from in-start below end
              when (or (= (aref buffer i) +cr+) (= (aref buffer i) +lf+))
                return i
              finally (return end))))))

(defun note-refusal (c response sent &key (line t) (log t))
  "RESPONSE, one of the engine's own answers (its status line at the start),
went to the request C was reading, the socket taking SENT octets of it (all
of it when the rest waits with C): count it for the metrics, and give it to
the engine's LOG-ANSWER (unless LOG is NIL: the layer above logged it
already), unless an answer to that request was counted already (its layer
above then logged it).  LOG-ANSWER is called in this
thread (a worker, the housekeeper, the layer above's listener) as (LOG-ANSWER
C STATUS BODY-OCTETS-SENT BUFFER START END), BUFFER[START,END) the request
line as received (when LINE, the input is at C's IN-START, up to
RECEIVED-LINE-END), BUFFER NIL when nothing of it came or it is gone.  The
head is in C's record only while CONNECTION-HEAD-PENDING-P.  LOG-ANSWER
must not block, nor keep BUFFER: C's buffers go back to the pool next."
  (declare (type octets response) (type fixnum sent))
  (unless (let ((request (connection-request c)))
            (and (plusp (request-begun request)) (request-answered request)))
    (let ((status (response-status response))
          (engine (connection-engine c)))
      (connection-count-answer c status)
      (let ((log (and log (engine-log-answer engine))))
        (when log
          (let ((end (and line (received-line-end c))))
            (handler-case
                (funcall log c status (response-body-sent response sent)
                         (and end (conn-slot c inbuf)) (if end (conn-slot c in-start) 0) (or end 0))
              (error (e) (log-engine-error engine "Logging an answer on ~A: ~A" c e)))))))))

(defun connection-local-address (c)
  (with-connection-slots (local-address local-port fd) c
    (unless local-address
      (multiple-value-setq (local-address local-port) (socket-local-name fd)))
    local-address))

(defun connection-local-port (c)
  (connection-local-address c)
  (conn-slot c local-port))

(defun connection-mark-boundary (c)
  "Tell C that a response is complete and the next read starts a new request.
That read answers end-of-file (ending the layer above's request loop) unless a
complete request head is already buffered; the connection is then parked in
epoll rather than closed."
  (setf (conn-slot c boundary) t))

;;; Buffers

(defun release-spool (c)
  "Give back the body the engine read for C's request, if any (spool.lisp)."
  (let* ((request (connection-request c))
         (spool (request-spool request)))
    (when spool
      (setf (request-spool request) nil
            (request-gathering request) nil)
      (free-spool (connection-engine c) spool))))

(declaim (inline ensure-inbuf))
(defun ensure-inbuf (c)
  (with-connection-slots (inbuf) c
    (or inbuf (setf inbuf (acquire-buffer)))))

(defun release-buffers (c)
  "Give back the buffers of C that hold nothing (and the head budget the input
buffer held, see CHARGE-HEAD)."
  (with-connection-slots (inbuf in-start in-end scan outbuf out-fill) c
    (when (and inbuf (= in-start in-end))
      (release-buffer inbuf)
      (setf inbuf nil in-start 0 in-end 0 scan 0)
      (uncharge-head c))
    (when (and outbuf (zerop out-fill))
      (release-buffer outbuf)
      (setf outbuf nil))))

;;; The head budget.  A connection parked with part of a request head holds
;;; its input buffer (8 KiB, or up to MAX-HEAD-BYTES when the head is long)
;;; while no worker serves it, and clients choose how many such connections
;;; there are.  The engine counts those buffers in HEAD-BYTES and keeps them
;;; under HEAD-BUDGET (a quarter of the heap by default), so that heads can
;;; never exhaust the heap: past it, a connection is answered 503 instead of
;;; being parked, and no buffer grows.  A buffer grown for a long head is
;;; counted from the moment it grows (CHARGE-GROWTH), whether parked or being
;;; read, and a counted buffer stays counted until the connection gives it
;;; back (RELEASE-BUFFERS) or closes.  Invariant: HEAD-BYTES is the sum of
;;; the BUDGETED octets of every connection, and BUDGETED is 0 or the length
;;; of the connection's input buffer.

(defun charge-head-octets (engine n)
  "Count N octets (N may be negative) of head buffers against ENGINE's head
budget and the memory account's :HEADS.  NIL, nothing counted, when either
would be exceeded."
  (declare (type fixnum n))
  ;; ATOMIC-INCF returns the old value.
  (cond ((or (> (+ n (sb-ext:atomic-incf (engine-head-bytes engine) n))
                (engine-head-budget engine))
             (not (account-charge :heads n)))
         (sb-ext:atomic-decf (engine-head-bytes engine) n)
         nil)
        (t t)))

(defun charge-head (c)
  "Count C's input buffer against the head budget if C is about to park with
a partial request in it.  NIL when that would exceed the budget."
  (with-connection-slots (inbuf in-start in-end budgeted engine) c
    (or (null inbuf) (= in-start in-end) (plusp budgeted)
        (let ((n (length (the octets inbuf))))
          (when (charge-head-octets engine n)
            (setf budgeted n)
            t)))))

(defun uncharge-head (c)
  "C gives its input buffer up (rejected or closed): give its share of the
budget back."
  (with-connection-slots (budgeted engine) c
    (when (plusp budgeted)
      (sb-ext:atomic-decf (engine-head-bytes engine) budgeted)
      (account-add :heads (- budgeted))
      (setf budgeted 0))))

(defun charge-growth (c size)
  "Before C's input buffer grows to SIZE octets, count SIZE against the
engine's head budget in place of what C already holds there.  NIL when that
would exceed the budget.  A buffer is charged while a worker reads into it,
not only once it is parked: otherwise every worker reading a long head could
grow one up to MAX-HEAD-BYTES beside the budget, and with a raised head limit
those together exhausted the heap.  (The plaintext side of TLS is charged
the same way; it gives its share back between requests and when it closes.)"
  (declare (type fixnum size))
  (with-connection-slots (engine budgeted) c
    (when (charge-head-octets engine (- size budgeted))
      (setf budgeted size)
      t)))

(defun make-room (c max)
  "Make space after IN-END in the input buffer: move unread bytes to the
front, or grow the buffer up to MAX bytes.  Returns NIL when it is full at
MAX, or when growing it would exceed the head budget (see CHARGE-GROWTH)."
  (with-connection-slots (inbuf in-start in-end scan) c
    (let ((buffer (ensure-inbuf c)))
      (declare (type octets buffer))
      (cond ((< in-end (length buffer)) t)
            ((plusp in-start)
             (replace buffer buffer :start2 in-start :end2 in-end)
             (decf scan in-start)
             (decf in-end in-start)
             (setf in-start 0)
             t)
            ((and (< (length buffer) max)
                  ;; Growing past the head budget would let heads exhaust
                  ;; the heap: the caller answers 431/503.
                  (charge-growth c (min max (* 2 (length buffer)))))
             (let ((bigger (make-array (min max (* 2 (length buffer)))
                                       :element-type '(unsigned-byte 8))))
               (replace bigger buffer :end2 in-end)
               (release-buffer buffer)
               (setf inbuf bigger)
               t))
            (t nil)))))

;;; Finding the end of a request head

(defconstant +max-blank-lines+ 8
  "Empty lines skipped before a request line, at most, between two requests.")

(defun scan-head (c)
  "Look for the end of the request head in the unread input (an empty line:
LF LF, or LF CR LF, so that a head with bare LFs ends too and is refused by
CHECK-HEAD instead of waiting for its timeout).  Returns :COMPLETE,
:INCOMPLETE, :LINE-TOO-LONG (request line over its limit: 414) or :TOO-LARGE
\(head over its limit: 431).  The limits are checked on the octets received
so far whether or not the head is complete, so they never depend on how the
octets were split into reads."
  (with-connection-slots (inbuf in-start in-end scan engine) c
    (unless inbuf
      (return-from scan-head :incomplete))
    (let ((buffer inbuf)
          (start in-start)
          (end in-end)
          (head-end nil))
      (declare (type octets buffer) (type fixnum start end)
               (optimize (speed 3) (safety 0)))
      ;; Skip empty lines (CRLF) before the request line (RFC 9112, 2.2), a
      ;; few: a client sending nothing but CRLFs, each just before the idle
      ;; timeout, would otherwise hold its connection for ever.  Past them
      ;; they are the start of a head (400, or the header timeout's 408).
      (loop while (and (< (1+ start) end)
                       (= (aref buffer start) +cr+) (= (aref buffer (1+ start)) +lf+)
                       (< (conn-slot c blank-lines) +max-blank-lines+))
            do (incf start 2)
               (incf (conn-slot c blank-lines)))
      (setf in-start start)
      (let ((i (max start (the fixnum scan))))
        (declare (type fixnum i))
        (loop while (< i end)
              do (when (= (aref buffer i) +lf+)
                   (let ((j (1+ i)))
                     (declare (type fixnum j))
                     (when (and (< j end) (= (aref buffer j) +cr+))
                       (incf j))
                     (cond ((>= j end) (return))
                           ((= (aref buffer j) +lf+)
                            (setf head-end (1+ j))
                            (return)))))
                 (incf i))
        (setf scan (or head-end i)))
      (let ((received (- (the fixnum (or head-end end)) start))
            (max-line (engine-max-request-line-bytes engine)))
        (declare (type fixnum received max-line))
        (cond ((and (> received max-line) ; else the request line is within it
                    (> (- (the fixnum (or (line-end buffer start end) end)) start) max-line))
               :line-too-long)
              ((> received (engine-max-head-bytes engine))
               :too-large)
              (head-end :complete)
              (t :incomplete))))))

;;; Blocking input with timeouts

(defun wait-for-fd (c events timeout-ms operation &optional (wake-fd -1))
  "Wait until C's fd is ready for EVENTS.  Returns :READY or :WAKE (the
engine is stopping); signals CONNECTION-TIMEOUT-ERROR after TIMEOUT-MS."
  (let ((result (poll-fds (connection-fd c) events wake-fd timeout-ms)))
    (when (eq result :timeout)
      (sb-ext:atomic-incf (engine-timeouts (connection-engine c)))
      (setf (conn-slot c timed-out) t)     ; for a TLS layer that hides the error (tls.lisp)
      (error 'connection-timeout-error :stream c :operation operation))
    result))

(defun client-went-away (c errno operation)
  "A read or send on C failed with ERRNO: signal CONNECTION-ERROR.  When the
client went away (broken pipe, reset), later sends are dropped without an
error: the handler was told once, and the layer above (Hunchentoot writing
a 500 after the failure) should not fail and log again."
  (when (or (= errno +epipe+) (= errno +econnreset+))
    (setf (conn-slot c gone) t))
  (error 'connection-error :stream c :errno errno :operation operation))

(defun read-timeout-ms (c)
  "The read timeout of C: for a switched C (see CONNECTION-SWITCH), the one
its handler set, else the engine's UPGRADED-IDLE-TIMEOUT when it has one:
the new protocol's reads wait for the client's next message, not for the
rest of a request; else the engine's READ-TIMEOUT."
  (let ((stream (conn-slot c timeout-stream))
        (engine (connection-engine c)))
    (or (and stream (sb-impl::fd-stream-timeout stream)
             (max 1 (round (* 1000 (sb-impl::fd-stream-timeout stream)))))
        (and (eq (conn-slot c switched) t) (plusp (engine-upgraded-idle-ms engine))
             (engine-upgraded-idle-ms engine))
        (engine-read-timeout-ms engine))))

(defun rate-ended-wait-p (c began)
  "True when the minimum data rate, not a timeout, ended a read on C that
began waiting at BEGAN: the rate's deadline came before the others.  Told
from the deadlines, not the clock, which reads up to a tick behind the
end of the wait."
  (let ((rate (body-rate-deadline c))
        (deadline (conn-slot c read-deadline)))
    (and rate
         (< rate (+ began (read-timeout-ms c)))
         (or (zerop deadline) (< rate deadline)))))

(defun read-wait-ms (c)
  "How long a read on C may wait: the read timeout (a switched C's own, see
CONNECTION-SWITCH), or less when C has a
READ-DEADLINE, or reads a body under the minimum data rate (RATE-START,
see BODY-RATE-DEADLINE) (0 once it passed)."
  (let* ((timeout (read-timeout-ms c))
         (deadline (conn-slot c read-deadline))
         (rate (body-rate-deadline c)))
    (when (and rate (or (zerop deadline) (< rate deadline)))
      (setf deadline rate))
    (if (plusp deadline)
        (max 0 (min timeout (- deadline (now-ms))))
        timeout)))

(declaim (inline earliest))
(defun earliest (deadline other)
  "The earlier of DEADLINE and OTHER (a deadline, or NIL: none)."
  (declare (type fixnum deadline))
  (if (and other (< (the fixnum other) deadline)) other deadline))

(defun body-rate-deadline (c)
  "When the body C's handler reads as it arrives falls under the minimum
data rate (RATE-DEADLINE), or NIL when no rate applies to C now."
  (let* ((request (connection-request c))
         (start (request-rate-start request)))
    (and (plusp start)
         (rate-deadline (connection-engine c) start (request-rate-octets request)))))

(defun write-wait-ms (c)
  "How long a write on C may wait for the client: the write timeout, or
less when the output it has not read yet has waited under the minimum
data rate (OUTPUT-RATE-DEADLINE)."
  (let ((timeout (engine-write-timeout-ms (connection-engine c)))
        (rate (output-rate-deadline c)))
    (if rate
        (max 0 (min timeout (- rate (now-ms))))
        timeout)))

(defun output-rate-quota (engine)
  "Octets a client must read of output waiting for it in each period of the
minimum rate's grace: the rate times the grace (1,200 by default)."
  (let ((rate (engine-min-rate engine)))
    (if (plusp rate)
        (max 1 (floor (* rate (engine-rate-grace-ms engine)) 1000))
        most-positive-fixnum)))

(defun output-rate-deadline (c)
  "When C's unsent output falls under the minimum data rate: the end of the
period that began at OUT-SINCE, unless the client reads the quota of the
period (OUTPUT-RATE-QUOTA) before, which begins a new one (SEND-UNSENT).
NIL when nothing waits or there is no minimum.  Only time spent waiting
for the client counts: a stream the application writes slowly
\(server-sent events) never has output waiting.  Per period, not on
average since the output began to wait: the kernel's buffers take hundreds
of KiB at once from a client that reads nothing, and later a few KiB more
as it compacts them, which on average would buy it minutes."
  (let ((engine (connection-engine c)))
    (and (conn-slot c unsent) (plusp (engine-min-rate engine))
         (+ (conn-slot c out-since) (engine-rate-grace-ms engine)))))

;;; OpenSSL forbids two threads to use one SSL object at once, and on TLS 1.3
;;; SSL_read may write too.  Until it is detached a connection has one owner
;;; at a time (a worker, or the thread answering a suspended request), which
;;; makes its SSL calls without a lock.  A detached or switched stream is
;;; its handler's, and a WebSocket library's threads write frames to it
;;; while its own thread waits in its read (hunchensocket's broadcast): each
;;; SSL call then holds the connection's SSL-LOCK.  The calls never wait
;;; (the socket is non-blocking); the waits for the socket, poll(2), are
;;; made outside the lock, so a reader waiting for its client holds up no
;;; writer.  Closing (END-TLS, FREE-TLS) holds it too, and a call under it
;;; finds no SSL object once freed.  (doc/design.md, "A detached stream's
;;; SSL calls take turns".)

(defmacro with-ssl ((address c) &body body)
  "BODY (one SSL call that does not wait) with ADDRESS bound to the SSL
object of C, whose TLS is open.  With C's SSL-LOCK held if it has one (see
above): then -1 and ECONNRESET, without BODY, when C's TLS ended meanwhile."
  (let ((lock (gensym "LOCK")) (connection (gensym "C")))
    `(let ((,connection ,c))
       (flet ((ssl-call (,address)
                (declare (type sb-ext:word ,address))
                ,@body))
         (declare (inline ssl-call))
         (let ((,lock (conn-slot ,connection ssl-lock)))
           (if ,lock
               (sb-thread:with-mutex (,lock)
                 (if (and (eq (conn-slot ,connection tls-phase) :open)
                          (plusp (the fixnum (conn-slot ,connection tls))))
                     (ssl-call (conn-slot ,connection tls))
                     (values -1 +econnreset+)))
               (ssl-call (connection-ssl ,connection))))))))

(defmacro with-ssl-lock ((c) &body body)
  "BODY, holding C's SSL-LOCK if it has one (see above)."
  (let ((lock (gensym "LOCK")))
    `(flet ((locked () ,@body))
       (declare (dynamic-extent #'locked))
       (let ((,lock (conn-slot ,c ssl-lock)))
         (if ,lock
             (sb-thread:with-mutex (,lock) (locked))
             (locked))))))

;;; Reading and sending on the socket, or through the connection's TLS
;;; (openssl.lisp).  Every read and send of a connection goes through these
;;; three, which answer as recv(2), send(2) and sendfile(2) do (a count, 0 at
;;; the end of the stream, or -1 and an errno), so everything above them is
;;; the same on both.  (A draining connection is read raw: what it sends is
;;; discarded, TLS or not.)  They count the octets read and sent for the
;;; metrics (TALLY-ADD), as does the one send that bypasses them, a raw
;;; connection's blocking send (SEND-ALL).  On the engine's TLS they are the
;;; plaintext's octets (OpenSSL reads and writes the socket itself); through
;;; a TLS library above the engine, the raw connection's, its TLS records.

(declaim (inline connection-recv connection-send))
(defun connection-recv (c buffer start end)
  "Read into BUFFER[START,END) from C without waiting (see above).  On TLS,
the handshake moves on first; a count short of END-START means the socket
is drained, as on a plain socket."
  (counting-octets (c +bytes-in-cell+)
    (if (zerop (the fixnum (conn-slot c tls)))
        (read-into (conn-slot c fd) buffer start end)
        (tls-recv c buffer start end))))

(defun connection-send (c buffer start end)
  "Send BUFFER[START,END) on C without waiting (see above).  On TLS, what
returned EAGAIN must be sent again with the same octets first."
  (counting-octets (c +bytes-out-cell+)
    (if (zerop (the fixnum (conn-slot c tls)))
        (send-from (conn-slot c fd) buffer start end)
        (tls-send c buffer start end))))

(defun connection-send-file-chunk (c file-fd offset count)
  "Send up to COUNT bytes of the file open on FILE-FD from OFFSET on C
without waiting (see above).  TLS reads the file into a buffer first, and on
EAGAIN reads the same octets again the next time."
  (counting-octets (c +bytes-out-cell+)
    (cond ((zerop (the fixnum (conn-slot c tls)))
           (send-file-chunk (conn-slot c fd) file-fd offset (min count (* 1024 1024))))
          ((not (eq (conn-slot c tls-phase) :open)) (values -1 +econnreset+))
          (t (let ((scratch (acquire-buffer)))
               (multiple-value-prog1 (multiple-value-call #'tls-outcome c
                                       (with-ssl (address c)
                                         (ssl-send-file address file-fd offset count scratch)))
                 (release-buffer scratch)))))))

(defun connection-ssl (c)
  "The address of C's SSL object, made now if it is not yet (the first read
is a worker's: a connection that never sends costs no SSL object); 0 when
C's TLS is over or OpenSSL could not make one."
  (with-connection-slots (tls tls-phase fd engine) c
    (cond ((eq tls-phase :over) 0)
          ((plusp tls) tls)
          (t (let ((address (ssl-make (engine-tls engine) fd)))
               ;; A handshake is several small writes in turn (a flight,
               ;; then session tickets, then the answer): Nagle would hold
               ;; each back until the client's delayed ACK, 40 ms.
               (set-nodelay fd)
               (if (zerop address)
                   (progn (setf tls-phase :over) 0)
                   (setf tls address)))))))

(defun tls-outcome (c n errno)
  "Pass on a TLS read's or send's answer; a failure means the TLS stream is
over (no close_notify can follow it)."
  (declare (type fixnum n errno))
  (when (and (minusp n) (/= errno +eagain+))
    (setf (conn-slot c tls-phase) :over))
  (values n errno))

(defun tls-recv (c buffer start end)
  "CONNECTION-RECV on TLS: the handshake, a step a call while it lasts, then
SSL-RECV.  A step that must write waits for the socket (bounded by the write
timeout): a handshake message is a few KiB, which a fresh socket takes."
  (loop
    (if (eq (conn-slot c tls-phase) :open)
        (multiple-value-bind (n errno ended)
            (with-ssl (address c) (ssl-recv address buffer start end))
          (declare (type fixnum n errno))
          (when ended
            ;; The stream's end (the client's close_notify, or a failure)
            ;; came with its last octets, and OpenSSL has read it: the
            ;; socket may raise no further event (a client that waits for
            ;; its answer before its FIN), so the short count must not
            ;; park C as drained.
            (setf (conn-slot c peer-closed) t))
          ;; The wait, if any, outside WITH-SSL.
          (if (and (minusp n) (= errno +want-write+))
              (unless (wait-for-socket c +pollout+ "TLS write")
                (return (tls-outcome c -1 +econnreset+)))
              (return (tls-outcome c n errno))))
        (let ((address (connection-ssl c)))
          (when (zerop address)
            (return (values -1 +econnreset+)))
          (ecase (ssl-handshake address)
            (:done (setf (conn-slot c tls-phase) :open)
             (tally-add c +tls-handshakes-cell+ 1))
            (:want-read
             ;; The handshake counts as part of the first request's head:
             ;; the header timeout bounds both (see PARK).
             (unless (conn-slot c head-started)
               (setf (conn-slot c head-started) (now-ms)))
             (return (values -1 +eagain+)))
            (:want-write
             (unless (wait-for-socket c +pollout+ "TLS handshake")
               (return (tls-outcome c -1 +econnreset+))))
            (:failed (return (tls-outcome c -1 +econnreset+))))))))

(defun wait-for-socket (c events operation)
  "Wait (bounded by the write timeout) until C's socket is ready for EVENTS;
NIL when it timed out."
  (handler-case (progn (wait-for-fd c events (engine-write-timeout-ms (connection-engine c))
                                    operation)
                       t)
    (connection-error () nil)))

(defun tls-send (c buffer start end)
  "CONNECTION-SEND on TLS: nothing goes out before the handshake is done."
  (if (eq (conn-slot c tls-phase) :open)
      (multiple-value-call #'tls-outcome c
        (with-ssl (address c) (ssl-send address buffer start end)))
      (values -1 +econnreset+)))

(defun connection-tls-p (c)
  "True when C speaks TLS on the engine's own event loop (openssl.lisp)."
  (/= 0 (the fixnum (conn-slot c tls))))

(defun tls-handshaking-p (c)
  "True while C's TLS handshake is not done."
  (and (/= 0 (the fixnum (conn-slot c tls))) (eq (conn-slot c tls-phase) :handshake)))

(defun end-tls (c)
  "C's TLS, if any, is over: send close_notify first if it is open (one
non-blocking send).  The SSL object stays until CLOSE-CONNECTION frees it."
  (unless (zerop (the fixnum (conn-slot c tls)))
    (with-ssl-lock (c)
      (when (and (eq (conn-slot c tls-phase) :open) (plusp (conn-slot c tls)))
        (ssl-close-notify (conn-slot c tls)))
      (setf (conn-slot c tls-phase) :over))))

(defun free-tls (c)
  "Free C's SSL object (C is closing), after its close_notify when still open."
  (unless (zerop (the fixnum (conn-slot c tls)))
    (end-tls c)
    (with-ssl-lock (c)
      (when (plusp (conn-slot c tls))
        (ssl-free (conn-slot c tls))
        (sb-ext:atomic-incf (engine-tls-freed (connection-engine c))))
      (setf (conn-slot c tls) -1))))

(defun fill-input (c)
  "Read more input into the empty buffer of C, blocking (bounded by the read
timeout) until some arrives.  Returns NIL at end of file."
  (when (conn-slot c source)
    (return-from fill-input (fill-from-source c)))
  (with-connection-slots (inbuf in-start in-end scan engine) c
    (let ((buffer (ensure-inbuf c)))
      (when (= in-start in-end)
        (setf in-start 0 in-end 0 scan 0))
      (loop
        (multiple-value-bind (n errno) (connection-recv c buffer in-end (length buffer))
          (setf (conn-slot c drained) (< n (- (length buffer) in-end)))
          (cond ((plusp n)
                 (incf in-end n)
                 (with-request-slots (rate-start rate-octets) (connection-request c)
                   (when (plusp rate-start)
                     (incf rate-octets n)))
                 (return t))
                ((zerop n) (return nil))
                ((/= errno +eagain+)
                 (client-went-away c errno "read"))
                (t (wait-for-fd c +pollin+ (read-wait-ms c) "read"))))))))

;;; The plaintext side of TLS through a library above the engine (tls.lisp)
;;; reads and writes its SOURCE, the library's TLS stream, instead of the
;;; socket: FILL-INPUT reads through FILL-FROM-SOURCE, SEND-ALL writes
;;; through SEND-TO-SOURCE.

(defun source-want (c)
  "How many octets C can read from its TLS stream without waiting for more
than the client must send: what is left of a Content-Length body or of a
chunk's data; else 1 (a head, or chunk framing, may end at any octet)."
  (with-request-slots (message head-left body-mode body-left chunk-decoder) (connection-request c)
    (cond ((or (not message) (plusp head-left)) 1)
          ((eq body-mode :length) (max 1 body-left))
          ((and (eq body-mode :chunked) (eq (chunk-decoder-state chunk-decoder) :data))
           (chunk-decoder-left chunk-decoder))
          (t 1))))

(defun fill-from-source (c)
  "Read into C's empty input buffer from its TLS stream, blocking (bounded by
the cipher connection's read timeout or deadline): at most SOURCE-WANT
octets, since the TLS stream only returns when it has all it was asked for
\(and LISTEN on it may block inside cl+ssl's Lisp BIO).  NIL at end of
file, or when the TLS stream failed otherwise (the client went away:
nobody to answer).  Signals HANDLER-TIMEOUT or CONNECTION-TIMEOUT-ERROR when
that is what happened under the TLS library."
  (with-connection-slots (inbuf in-start in-end scan source) c
    (let ((buffer (ensure-inbuf c)))
      (declare (type octets buffer))
      (when (= in-start in-end)
        (setf in-start 0 in-end 0 scan 0))
      (let ((want (min (source-want c) (- (length buffer) in-end))))
        (and (plusp want)
             (handler-case
                 (let ((end (read-sequence buffer source :start in-end :end (+ in-end want))))
                   (when (> end in-end)
                     (setf in-end end)
                     t))
               (error ()
                 ;; The TLS library turned our own condition, raised while it
                 ;; read through the cipher connection, into an error of its
                 ;; own: give the handler-deadline interrupt and the read
                 ;; timeout back their meaning (503 / a quiet close), as on a
                 ;; plain connection.  Anything else: the client is gone.
                 (let ((cipher (conn-slot c cipher)))
                   (cond ((conn-slot cipher interrupted)
                          (let ((ms (engine-handler-timeout-ms (connection-engine c))))
                            (error 'handler-timeout
                                   :seconds (and (plusp ms) (not (conn-slot cipher stop-cut))
                                                 (/ ms 1000.0)))))
                         ((conn-slot cipher timed-out)
                          (setf (conn-slot cipher timed-out) nil)
                          (error 'connection-timeout-error :stream c :operation "TLS read"))
                         (t nil))))))))))

(defun send-to-source (c buffer start end)
  "Write BUFFER[START,END) through C's TLS stream."
  (when (conn-slot c gone)
    (return-from send-to-source))
  (handler-case
      (let ((source (conn-slot c source)))
        (write-sequence buffer source :start start :end end)
        (force-output source)
        (incf (the fixnum (conn-slot c sent)) (- end start)))
    (error (e)
      (setf (conn-slot c gone) t)
      (error 'connection-error :stream c :operation (format nil "TLS write (~A)" e)))))

;;; Output.  Writes go to the connection's output buffer, and from there to
;;; the socket without waiting: what the socket does not take now (the client
;;; reads slowly, or not at all) stays with the connection in its output
;;; queue, UNSENT, and the writer goes on.  After the handler, a connection
;;; with unsent output waits in epoll for EPOLLOUT (OUTPUT-PARKED-P), holding
;;; no worker, and reads no further pipelined request until the queue is sent;
;;; a worker sends the rest when the socket drains, bounded by the write
;;; timeout from the last progress (then the housekeeper closes it and counts
;;; it in :WRITE-TIMEOUTS).
;;;
;;; The queue keeps the octets it holds in one of three ways: the output
;;; buffer itself, handed over (a fresh one is taken for the next write),
;;; unless less than half of it is left to send, which is copied instead;
;;; a reference to octets the caller gives up (a native app's response body);
;;; or a copy.  A file is queued as a duplicate of its fd and sent with
;;; sendfile(2).  What the queue holds is counted in the memory account
;;; (kind :OUTPUT, account.lisp), by the heap it takes (see below).
;;;
;;; What a streaming writer queues, copies and handed-over buffers, grows
;;; with what it writes, not with what its client reads; so the account, not
;;; the client, bounds it.  Up to the engine's MAX-UNSENT-BYTES a connection
;;; queues it as any other output.  Past that, each further piece is copied
;;; into spill buffers (SPILL-UNSENT): a new one, of +SPILL-OCTETS+ at least,
;;; is charged to the account before it is made (ACCOUNT-CHARGE), and given
;;; back once sent or dropped, as every segment is.  While the account takes
;;; them the writer goes on, so that a handler streaming to a slow reader
;;; finishes and lets go of its worker, and the rest waits in epoll as a
;;; buffered answer does.  (Large buffers, not a copy per write nor a
;;; handed-over 8 KiB buffer holding a chunk's size line: what the collector
;;; copies, and what the heap holds per octet queued, would grow with the
;;; output.)  One connection holds at most SPILL-LIMIT so, a 64th of the
;;; account's limit: a large download to a slow client then waits for its
;;; client, holding its worker, instead of filling the account alone and
;;; being closed as the largest holder.  Only a piece refused by that limit or by the account
;;; makes the writer wait for its client (WAIT-FOR-ROOM), and at most
;;; MAX-WAITING-WRITERS writers of an engine wait at once: past them, the
;;; connection is closed instead (reset, counted in :WRITERS-SHED), so that
;;; however many slow readers there are, they hold no more workers than
;;; that.  A writer queuing past MAX-UNSENT-BYTES holds its client to the
;;; terms a parked connection's client has, the write timeout and the
;;; minimum data rate (READER-STALLED-P): a handler that streams on to a
;;; client reading nothing is stopped, instead of filling the account for
;;; everyone.  Octets given up by reference and files are never refused (the
;;; first are held by their owner whether queued or not; the second are not
;;; memory), nor is an upgraded connection's output, which its sends bound
;;; before it comes here (upgrade.lisp).
;;;
;;; TLS through a library above the engine (SOURCE) and detached connections
;;; (RAW) keep blocking sends: a TLS library writing through the stream, or a
;;; handler that kept it, expects every octet gone when the write returns.
;;; Neither takes a pool worker that is not taken already: a TLS library's
;;; connection holds its worker for as long as it is open (tls.lisp), and a
;;; detached or switched stream's writer is its owner's thread (outside the
;;; pool, for a switched one), which a slow reader holds for at most the
;;; write timeout without progress.
;;;
;;; Invariants: UNSENT holds no empty segment; UNSENT-BYTES is the sum of
;;; its segments' remaining octets; only its last segment takes more octets
;;; (QUEUE-COPY, SPILL-UNSENT), and never while it is also its first; while
;;; UNSENT is not empty, nothing is sent to the socket except from its front
;;; (order on the wire is the order of the writes).

;;; What the queues hold is counted in the memory account as :OUTPUT, by
;;; segment: the heap its octets take (OCTETS-FOOTPRINT) from when the
;;; segment is made until it is freed, whole, since a vector half sent is
;;; still all in memory.  A connection's own count of what waits for its
;;; client (UNSENT-BYTES, an upgraded connection's MAILBOX-BYTES) is the
;;; octets still to send: its backpressure, and its send limit.
;;;
;;; Shared octets.  One message sent to many connections (a WebSocket
;;; broadcast) is made once and queued by reference on each: every queue
;;; holding it has a segment of its own (its own START, advanced as the
;;; socket takes it), all over the same octets, which nothing writes to once
;;; shared.  The account counts them once, from when they are made until the
;;; last queue lets go of them; each connection's backlog counts them in
;;; full, since that is what its client has not read.

(defun octets-footprint (n)
  "Octets of the heap an octet vector of N elements takes: its header and
data, and its share of the allocator's page (SB-VM:GENCGC-PAGE-BYTES), of
which it holds a whole number: a vector a little over half a page takes a
page (a 16 KiB message's frame takes 32 KiB).  Counting what a vector
takes, not its length, keeps the account's limits true of the heap."
  (declare (type fixnum n))
  (let ((size (* 16 (ceiling (+ n (* 2 sb-vm:n-word-bytes)) 16)))
        (page sb-vm:gencgc-page-bytes))
    (if (<= size page)
        (ceiling page (floor page size))
        (* page (ceiling size page)))))

(defstruct (shared-octets (:constructor %make-shared-octets (octets))
                          (:copier nil) (:predicate nil))
  "OCTETS queued on several connections, counted once in the memory account."
  (octets nil :type octets :read-only t)
  ;; The queues holding them, and their maker until it lets go.
  (holders 1 :type sb-ext:word))

(defmethod print-object ((shared shared-octets) stream)
  (print-unreadable-object (shared stream :type t :identity t)
    (format stream "~D octets, ~D holders" (length (shared-octets-octets shared))
            (shared-octets-holders shared))))

(defun make-shared-octets (octets)
  "OCTETS, to be queued on many connections (CONNECTION-SEND-SHARED) and
never written to again: counted in the memory account as :OUTPUT now, and
given back when the maker (RELEASE-SHARED-OCTETS) and every queue holding
them let go."
  (declare (type octets octets))
  (account-add :output (octets-footprint (length octets)))
  (%make-shared-octets octets))

(declaim (inline retain-shared-octets))
(defun retain-shared-octets (shared)
  (sb-ext:atomic-incf (shared-octets-holders shared)))

(defun release-shared-octets (shared)
  "One holder of SHARED lets go of it; the last gives its octets back to the
memory account."
  ;; ATOMIC-DECF returns the count before.
  (when (= 1 (sb-ext:atomic-decf (shared-octets-holders shared)))
    (account-add :output (- (octets-footprint (length (shared-octets-octets shared))))))
  nil)

(defconstant +spill-octets+ (* 256 1024)
  "The least size of a spill buffer (see SPILL-UNSENT).  Past 128 KiB an
octet vector is one of SBCL's large objects, which its collector never
copies: a writer's queued output then costs the collections nothing,
however much of the heap it takes.")

(defstruct (segment (:constructor make-segment (octets start end &optional pooled (file-fd -1)))
                    (:constructor make-shared-segment
                        (shared &aux (octets (shared-octets-octets shared))
                                  (start 0) (end (length octets))))
                    (:constructor make-spill-segment
                        (octets end counted &aux (start 0) (spill t)))
                    (:copier nil) (:predicate nil))
  "Octets START to END of OCTETS (POOLED: a buffer of the buffer pool, given
back once sent; SHARED: the SHARED-OCTETS record OCTETS are of, let go of
once sent; SPILL: a spill buffer, whose octets past END are room for more,
see SPILL-UNSENT), or, when OCTETS is NIL, bytes START to END of the file
open on FILE-FD, which the segment owns."
  (octets nil :type (or null octets))
  (start 0 :type fixnum)
  (end 0 :type fixnum)
  (pooled nil)
  (spill nil)
  (file-fd -1 :type fixnum)
  (shared nil :type (or null shared-octets))
  (counted 0 :type fixnum))             ; in the memory account, until freed

(defmethod print-object ((segment segment) stream)
  (print-unreadable-object (segment stream :type t :identity t)))

(defun count-segment (segment)
  "Count SEGMENT's octets in the memory account, once, until it is freed:
octets of its own (shared ones are counted once for all their segments, a
file's are not in memory)."
  (when (and (zerop (segment-counted segment)) (segment-octets segment)
             (null (segment-shared segment)))
    (let ((n (octets-footprint (length (the octets (segment-octets segment))))))
      ;; Counted and noted at once: see SEND-ALL.
      (sb-sys:without-interrupts
        (account-add :output n)
        (setf (segment-counted segment) n)))))

(defun free-segment (segment)
  (when (plusp (segment-counted segment))
    (sb-sys:without-interrupts
      (account-add :output (- (shiftf (segment-counted segment) 0)))))
  (cond ((segment-shared segment)
         (release-shared-octets (shiftf (segment-shared segment) nil)))
        ((segment-octets segment)
         (when (segment-pooled segment)
           (release-buffer (segment-octets segment))))
        ((>= (segment-file-fd segment) 0)
         (close-fd (segment-file-fd segment))))
  (setf (segment-octets segment) nil (segment-file-fd segment) -1))

(defun queue-unsent (c segment)
  "Append SEGMENT (not empty) to C's unsent output."
  (with-connection-slots (unsent-bytes sent) c
    (let ((cell (list segment))
          (size (- (segment-end segment) (segment-start segment))))
      (if (conn-slot c unsent)
          (setf (cdr (conn-slot c unsent-tail)) cell)
          (setf (conn-slot c unsent) cell
                (conn-slot c out-progress) (now-ms)
                (conn-slot c out-since) (conn-slot c out-progress)
                (conn-slot c out-drained) 0
                (conn-slot c out-acked) (or (tcp-bytes-acked (connection-fd c)) 0)))
      (setf (conn-slot c unsent-tail) cell)
      (incf unsent-bytes size)
      (count-segment segment)
      ;; Counted as sent: it is committed, and goes out before anything else.
      (incf sent size))))

(defun queue-copy (c octets start end)
  "Append a copy of OCTETS[START,END), a few octets, to C's unsent output
\(not empty): into the pool buffer its last segment is when that has room,
else into a fresh one.  So a client that does not read costs a buffer per
+BUFFER-SIZE+ of small messages, not one each.  (Never into the segment the
socket is taking: on TLS it must be offered the same octets again.)"
  (declare (type octets octets) (type fixnum start end))
  (let ((n (- end start))
        (tail (car (conn-slot c unsent-tail))))
    (if (and tail (segment-pooled tail)
             (not (eq tail (car (conn-slot c unsent))))
             (<= (+ (segment-end tail) n) (length (the octets (segment-octets tail)))))
        (progn
          (replace (the octets (segment-octets tail)) octets
                   :start1 (segment-end tail) :start2 start :end2 end)
          (incf (segment-end tail) n)
          (incf (the fixnum (conn-slot c unsent-bytes)) n)
          (incf (the fixnum (conn-slot c sent)) n))
        (let ((buffer (acquire-buffer)))
          (replace buffer octets :start2 start :end2 end)
          (queue-unsent c (make-segment buffer 0 n t))))))

(defun discard-unsent (c &key keep-first)
  "Drop C's unsent output (C is closing); with KEEP-FIRST, all but its first
segment, the one the socket is taking."
  (with-connection-slots (unsent unsent-bytes) c
    (let ((kept (and keep-first unsent (car unsent))))
      (loop for segment in (if kept (cdr unsent) unsent) do (free-segment segment))
      (if kept
          (setf unsent (list kept)
                (conn-slot c unsent-tail) unsent
                unsent-bytes (- (segment-end kept) (segment-start kept)))
          (setf unsent nil
                (conn-slot c unsent-tail) nil
                unsent-bytes 0)))))

(defun spill-limit ()
  "The most octets one connection may hold unsent, spill buffers included: a
64th of the account's limit (8 MiB of half a 1 GiB heap)."
  (floor (account-limit) 64))

(defun spill-tail (c)
  "C's last unsent segment when it is a spill buffer that may take more: not
also the first, which the socket is taking (on TLS it must be offered the
same octets again)."
  (let ((unsent (conn-slot c unsent)))
    (and unsent (cdr unsent)
         (let ((tail (car (conn-slot c unsent-tail))))
           (and (segment-spill tail) tail)))))

(defun spill-room (c)
  "Octets C's last spill buffer can still take (SPILL-TAIL), or 0."
  (let ((tail (spill-tail c)))
    (if tail
        (- (length (the octets (segment-octets tail))) (segment-end tail))
        0)))

(defun spill-unsent (c buffer start end size)
  "Copy BUFFER[START,END) to the end of C's unsent output: as much as fits
into the room of its last spill buffer (SPILL-TAIL), the rest into a new one
of SIZE octets (0: none needed), whose footprint is charged to the memory
account already."
  (declare (type octets buffer) (type fixnum start end size))
  (let ((tail (spill-tail c)))
    (when tail
      (let* ((fill (segment-end tail))
             (n (min (- end start) (- (length (the octets (segment-octets tail))) fill))))
        (replace (the octets (segment-octets tail)) buffer :start1 fill :start2 start :end2 (+ start n))
        (setf (segment-end tail) (+ fill n))
        (incf (the fixnum (conn-slot c unsent-bytes)) n)
        (incf (the fixnum (conn-slot c sent)) n)
        (incf start n))))
  (when (< start end)
    (let ((octets (make-array size :element-type '(unsigned-byte 8))))
      (replace octets buffer :start2 start :end2 end)
      (queue-unsent c (make-spill-segment octets (- end start) (octets-footprint size))))))

(defun connection-give-body (c)
  "Say that the next whole octet vector written to C with WRITE-SEQUENCE is
this answer's body, given up by its owner: queued, if the client does not
read it at once, by reference instead of copied (and so never refused by
the memory account, see Output above).  Hunchentoot's layer says so for a body a
handler returned.  Holds until the next request."
  (setf (conn-slot c body-given) t))

(defun connection-unsent-bytes (c)
  "Octets of output C holds that the socket has not taken yet."
  (conn-slot c unsent-bytes))

(defun send-unsent (c)
  "Send C's unsent output as far as the socket takes it now, without waiting.
True when nothing is left, NIL when the socket is full.  Signals
CONNECTION-ERROR when the client went away."
  (with-connection-slots (unsent unsent-bytes) c
    (loop
      (let ((segment (car unsent)))
        (unless segment
          (setf (conn-slot c unsent-tail) nil)
          (return t))
        (let ((start (segment-start segment))
              (end (segment-end segment)))
          (multiple-value-bind (n errno)
              (if (segment-octets segment)
                  (connection-send c (segment-octets segment) start end)
                  (connection-send-file-chunk c (segment-file-fd segment) start (- end start)))
            (declare (type fixnum n))
            (cond ((plusp n)
                   (let ((now (now-ms)))
                     (setf (segment-start segment) (+ start n)
                           (conn-slot c out-progress) now)
                     (when (>= (incf (conn-slot c out-drained) n)
                               (output-rate-quota (connection-engine c)))
                       ;; The client read its share of this period: a new one.
                       (setf (conn-slot c out-since) now
                             (conn-slot c out-drained) 0)))
                   (decf unsent-bytes n)
                   (when (= (+ start n) end)
                     (pop unsent)
                     (free-segment segment)))
                  ((and (minusp n) (= errno +eagain+)) (return nil))
                  ((zerop n)
                   (error 'connection-error :stream c :operation "sendfile (file shrank)"))
                  (t (client-went-away c errno "write")))))))))

(defun finish-unsent (c)
  "Send all of C's unsent output, waiting for the socket (bounded by the
write timeout): before a blocking write (TLS, a detached stream)."
  (let ((timeout (engine-write-timeout-ms (connection-engine c))))
    (loop until (send-unsent c)
          do (wait-for-fd c +pollout+ timeout "write"))))

(defun client-read-a-period-p (c)
  "At the end of a period of C's waiting output, with a minimum rate: true
when the client's TCP acknowledged the period's quota since it was last
looked at, which begins a new period and counts as progress for the write
timeout.  (Without a minimum rate, NIL: progress is what the socket takes,
and the kernel compacting a non-reader's queue now and then acknowledges
a few octets, which would keep it for good.)  The socket's writable events come only once the
kernel's unsent output fell well under TCP_NOTSENT_LOWAT (16 KiB), so a
client reading slowly but above the rate could otherwise be cut off."
  (let ((acked (and (plusp (engine-min-rate (connection-engine c)))
                    (tcp-bytes-acked (connection-fd c)))))
    (when acked
      (let ((new (- acked (conn-slot c out-acked))))
        (when (>= new (output-rate-quota (connection-engine c)))
          (let ((now (now-ms)))
            (setf (conn-slot c out-acked) acked
                  (conn-slot c out-since) now
                  (conn-slot c out-drained) 0
                  (conn-slot c out-progress) now)
            t))))))

(defun output-deadlines (c)
  "C's waiting output: the end of its write timeout from the last progress,
and of the minimum rate's period (or NIL)."
  (values (+ (conn-slot c out-progress) (engine-write-timeout-ms (connection-engine c)))
          (output-rate-deadline c)))

(defun body-deadlines (c)
  "The body the engine reads for C (GATHER-BODY): the end of its read
timeout from the last octets, and when it falls under the minimum rate (or
NIL)."
  (values (+ (request-progress (connection-request c))
             (engine-read-timeout-ms (connection-engine c)))
          (body-rate-deadline c)))

(defun head-deadlines (c)
  "The partial request head of C: the end of its header timeout, and when
what came of it falls under the minimum rate (NIL before its first octet,
or during a TLS handshake, whose octets are not counted here)."
  (let ((engine (connection-engine c))
        (started (conn-slot c head-started))
        (octets (- (conn-slot c in-end) (conn-slot c in-start))))
    (values (+ started (engine-header-timeout-ms engine))
            (and (plusp octets) (rate-deadline engine started octets)))))

(defun output-deadline (c)
  "When C's waiting output ends the connection: the earlier of its
OUTPUT-DEADLINES."
  (multiple-value-call #'earliest (output-deadlines c)))

(defun reader-timed-out (c)
  "C's client read too little of its waiting output in time: count it as a
write timeout (and a slow client when the minimum rate's deadline came
first), and signal CONNECTION-TIMEOUT-ERROR; the connection is reset when
it closes."
  (let ((engine (connection-engine c))
        (rate (output-rate-deadline c)))
    (sb-ext:atomic-incf (engine-timeouts engine))
    (sb-ext:atomic-incf (engine-write-timeouts engine))
    (when (and rate (< rate (+ (conn-slot c out-progress) (engine-write-timeout-ms engine))))
      (sb-ext:atomic-incf (engine-slow-clients engine)))
    (setf (conn-slot c timed-out) t)
    ;; At once (see SET-RESET-ON-CLOSE), not once the client read.
    (set-reset-on-close (connection-fd c))
    (error 'connection-timeout-error :stream c :operation "write")))

(defun wait-for-reader (c)
  "Wait until C's socket takes more output, bounded by the write timeout or,
sooner, the minimum data rate of the client's reading (WRITE-WAIT-MS; a
period in which the client's TCP acknowledged its quota begins another,
CLIENT-READ-A-PERIOD-P).  Past it, READER-TIMED-OUT."
  (loop
    (unless (eq :timeout (poll-fds (connection-fd c) +pollout+ -1 (write-wait-ms c)))
      (return :ready))
    (unless (client-read-a-period-p c)
      (reader-timed-out c))))

(defun reader-stalled-p (c)
  "True when C's waiting output is past the deadline a parked connection's
would be closed at (OUTPUT-DEADLINE): its client read nothing for the write
timeout, or less than the minimum rate's quota in the period, and its TCP
acknowledged no more since (CLIENT-READ-A-PERIOD-P)."
  (and (conn-slot c unsent)
       (>= (now-ms) (output-deadline c))
       (not (client-read-a-period-p c))))

(define-condition connection-shed-error (connection-timeout-error)
  ()
  (:report (lambda (c s)
             (format s "~A on ~A: its client reads too slowly for the server to keep ~
                        what it writes (the memory account is full, or its writers ~
                        waiting for clients are); closed"
                     (connection-error-operation c) (stream-error-stream c))))
  (:documentation "A write past MAX-UNSENT-BYTES that the memory account refused,
when the engine's MAX-WAITING-WRITERS writers waited for their clients
already (WAIT-FOR-ROOM).  A timeout of the client's to the layers above: logged
at most once a minute."))

(defun wait-for-room (c &key (bounded t))
  "The memory account refused output C's writer would queue: wait for the
client to read some (WAIT-FOR-READER) while fewer than the engine's
MAX-WAITING-WRITERS writers wait; past them, close C instead: it is counted
in :WRITERS-SHED, its unsent output dropped, and CONNECTION-SHED-ERROR is
signalled; C closes, reset, once its handler returns.  Not BOUNDED (C's own
spill limit refused, memory plentiful), it waits whatever the count, as a
writer past its share always did: its write timeout and the minimum rate
bound that."
  (let ((engine (connection-engine c)))
    ;; The count is taken and given back with interrupts off, so that a
    ;; handler deadline's interrupt cannot leave it counted.
    (when (sb-sys:without-interrupts
            (if (or (< (sb-ext:atomic-incf (engine-waiting-writers engine))
                       (engine-max-waiting-writers engine))
                    (not bounded))
                (unwind-protect (sb-sys:with-local-interrupts (wait-for-reader c) nil)
                  (sb-ext:atomic-decf (engine-waiting-writers engine)))
                (progn (sb-ext:atomic-decf (engine-waiting-writers engine))
                       t)))
      (sb-ext:atomic-incf (engine-writers-shed engine))
      ;; C closes as soon as its handler is done, whether or not the handler
      ;; heeds the error: what waits is dropped, later writes too, and the
      ;; close resets it.
      (discard-unsent c)
      (setf (conn-slot c timed-out) t
            (request-framing-broken (connection-request c)) t
            (conn-slot c gone) t)
      (set-reset-on-close (connection-fd c))
      (error 'connection-shed-error :stream c :operation "write"))))

(defun send-all (c buffer start end &optional (keep :copy))
  "Send BUFFER[START,END) after C's unsent output.  What the socket does not
take now is queued (see above): KEEP :COPY copies it, :REFERENCE keeps BUFFER
itself, :HAND-OVER keeps BUFFER, a pooled buffer, and gives it back once
sent.  Past MAX-UNSENT-BYTES a copy or a hand-over is copied into a spill
buffer instead (SPILL-UNSENT), charged to the memory account, and waits for
the client when the account refuses (WAIT-FOR-ROOM).  Returns :KEPT when
BUFFER itself was queued.  On a RAW connection, blocks until all is sent."
  (declare (type octets buffer) (type fixnum start end))
  (when (conn-slot c source)
    (return-from send-all (send-to-source c buffer start end)))
  (when (conn-slot c gone)
    (return-from send-all nil))
  (let ((engine (connection-engine c)))
    (when (conn-slot c raw)
      (when (conn-slot c unsent) (finish-unsent c))
      (let ((timeout (engine-write-timeout-ms engine)))
        (loop while (< start end)
              ;; Through CONNECTION-SEND: a detached connection on the
              ;; engine's own TLS still speaks TLS.
              do (multiple-value-bind (n errno) (connection-send c buffer start end)
                   (declare (type fixnum n))
                   (cond ((>= n 0) (incf start n) (incf (the fixnum (conn-slot c sent)) n))
                         ((= errno +eagain+) (wait-for-fd c +pollout+ timeout "write"))
                         (t (client-went-away c errno "write"))))))
      (return-from send-all nil))
    (let ((spill nil)   ; past MAX-UNSENT-BYTES: a new spill buffer's size (charged), or 0
          (refused nil)) ; why MAY-QUEUE-P said no: :OWN (C's spill limit) or :ACCOUNT
      (flet ((may-queue-p ()
               ;; What is left may join the queue now (see Output above);
               ;; NIL when the account refused it.
               (or (eq keep :reference)
                   (conn-slot c upgrade)
                   (<= (+ (conn-slot c unsent-bytes) (- end start))
                       (engine-max-unsent-bytes engine))
                   (progn
                     (when (reader-stalled-p c)
                       (reader-timed-out c))
                     (let ((short (- end start (spill-room c))))
                       (if (<= short 0)
                           (setf spill 0)
                           (let ((size (max short +spill-octets+)))
                             (cond ((> (+ (conn-slot c unsent-bytes) size) (spill-limit))
                                    (setf refused :own)
                                    nil)
                                   ;; Charged and noted at once: an interrupt
                                   ;; (a handler deadline) between the two
                                   ;; would leave the charge for good.
                                   ((sb-sys:without-interrupts
                                      (and (account-charge :output (octets-footprint size))
                                           (setf spill size))))
                                   (t (setf refused :account)
                                      nil))))))))
             (wait ()
               ;; C's own spill limit, memory plentiful: wait for its client
               ;; as a writer past it always did (the write timeout and the
               ;; minimum rate bound it).  The account: bounded waiting.
               (wait-for-room c :bounded (not (and (eq refused :own)
                                                   (zerop (overload-level)))))))
        (unwind-protect
            (progn
              (loop while (< start end)
                    do (if (or (null (conn-slot c unsent)) (send-unsent c))
                           ;; Nothing queued: straight to the socket.
                           (multiple-value-bind (n errno) (connection-send c buffer start end)
                             (cond ((>= n 0) (incf start n) (incf (the fixnum (conn-slot c sent)) n))
                                   ((/= errno +eagain+) (client-went-away c errno "write"))
                                   ((may-queue-p) (return))
                                   (t (wait))))
                           ;; Queued output waits: queue behind it, or wait for room.
                           (if (may-queue-p)
                               (return)
                               (wait))))
              (when (< start end)
                (when (conn-slot c shed)
                  ;; The overload manager closes C: nothing more is queued for it
                  ;; (the spill buffer's charge is given back below).
                  (set-reset-on-close (connection-fd c))
                  (error 'connection-error :stream c :operation "write (shed: the server is short of memory)"))
                (if spill
                    (sb-sys:without-interrupts
                      (spill-unsent c buffer start end spill)
                      ;; Queued: its charge is the queue's now.
                      (setf spill nil))
                    (ecase keep
                      (:copy (queue-unsent c (make-segment (subseq buffer start end) 0 (- end start))))
                      (:reference (queue-unsent c (make-segment buffer start end)) :kept)
                      (:hand-over
                       (if (< (* 2 (- end start)) (length buffer))
                           ;; Mostly empty (a writer's flush after a short
                           ;; write): a copy costs what it holds, the buffer more.
                           (queue-unsent c (make-segment (subseq buffer start end) 0 (- end start)))
                           (progn (queue-unsent c (make-segment buffer start end t)) :kept)))))))
          ;; Charged and not queued (an error, the shed, an interrupt): given back.
          (when (and spill (plusp spill))
            (account-add :output (- (octets-footprint spill)))))))))

(declaim (inline output-buffer))
(defun output-buffer (c)
  "C's output buffer, taken from the pool if C has none."
  (or (conn-slot c outbuf) (setf (conn-slot c outbuf) (acquire-buffer))))

(defun flush-output (c)
  "Send what C's output buffer holds (see SEND-ALL): afterwards the buffer is
empty, or, when the socket did not take all of it, handed to the queue (the
next write takes a fresh one)."
  (with-connection-slots (outbuf out-fill) c
    (when (plusp out-fill)
      (let ((n out-fill))
        (setf out-fill 0)
        (when (eq (send-all c outbuf 0 n :hand-over) :kept)
          (setf outbuf nil))))))

(defmethod sb-gray:stream-write-byte ((c connection) byte)
  (with-connection-slots (outbuf out-fill) c
    (when (and outbuf (= out-fill (length (the octets outbuf))))
      (flush-output c))
    (let ((buffer (output-buffer c)))
      (declare (type octets buffer))
      (setf (aref buffer out-fill) byte)
      (incf out-fill)
      byte)))

(defmethod sb-gray:stream-write-sequence ((c connection) sequence &optional (start 0) end)
  (with-connection-slots (out-fill) c
    (let* ((end (or end (length sequence)))
           (buffer (output-buffer c)))
      (declare (type octets buffer) (type fixnum start end))
      (cond ((and (typep sequence 'octets) (> (- end start) (- (length buffer) out-fill)))
             ;; Too big for the buffer: send what is buffered, then the data itself.
             (flush-output c)
             (if (> (- end start) (length buffer))
                 ;; The caller's octets: copied if queued, unless they are
                 ;; the whole body the layer above gave up.
                 (send-all c sequence start end
                           (if (and (conn-slot c body-given) (zerop start) (= end (length sequence)))
                               (progn (setf (conn-slot c body-given) nil) :reference)
                               :copy))
                 (progn (replace (the octets (output-buffer c)) sequence :start2 start :end2 end)
                        (setf out-fill (- end start)))))
            ((typep sequence 'octets)
             (replace buffer sequence :start1 out-fill :start2 start :end2 end)
             (incf out-fill (- end start)))
            (t
             (loop for i from start below end
                   do (sb-gray:stream-write-byte c (elt sequence i)))))
      sequence)))

(defmethod sb-gray:stream-force-output ((c connection))
  (flush-output c)
  nil)

(defmethod sb-gray:stream-finish-output ((c connection))
  (flush-output c)
  nil)

(defmethod sb-gray:stream-clear-output ((c connection))
  (setf (conn-slot c out-fill) 0)
  nil)

;;; The octet interface the native layer uses: no generic dispatch.

(defun connection-head (c)
  "The buffer holding the request head just checked, its start and its end
\(just after the blank line).  Once the head was consumed (CONNECTION-
CONSUME-HEAD, CONNECTION-TAKE-HEAD) only the buffer is meant: the record
\(CONNECTION-REQUEST) has the head's positions in it."
  (with-connection-slots (inbuf in-start scan) c
    (values inbuf in-start scan)))

(declaim (inline connection-close-after-p))
(defun connection-close-after-p (c)
  "True when the connection must close after the answer to this request."
  (let ((request (connection-request c)))
    (or (request-close-after request) (request-framing-broken request))))
;;; The same contract as SEND-ALL's KEEP: a native app's response body is
;;; given up by the app (:REFERENCE), a streaming writer's data is copied.
(defun connection-write-octets (c octets &optional (start 0) (end (length octets)) (keep :copy))
  "Buffer OCTETS[START,END) for sending; large ones are sent directly (what
the socket does not take then is queued as KEEP says, see SEND-ALL)."
  (declare (type octets octets) (type fixnum start end))
  (with-connection-slots (out-fill) c
    (let ((buffer (output-buffer c)))
      (declare (type octets buffer))
      (cond ((<= (- end start) (- (length buffer) out-fill))
             (replace buffer octets :start1 out-fill :start2 start :end2 end)
             (incf out-fill (- end start)))
            ((<= (- end start) (length buffer))
             (flush-output c)
             (replace (the octets (output-buffer c)) octets :start2 start :end2 end)
             (setf out-fill (- end start)))
            (t
             (flush-output c)
             (send-all c octets start end keep)))))
  nil)

(defun connection-write-segment (c segment)
  "Send SEGMENT (octets in memory, not empty, given up by the caller) after
C's output, without waiting: what the socket does not take now is queued as
SEGMENT itself, its octets neither copied nor written to (shared ones stay
shared).  An upgraded connection's sends come this way (upgrade.lisp).
Signals CONNECTION-ERROR when the client went away; SEGMENT is let go of
whatever happens to C."
  (declare (type segment segment))
  (let ((kept nil))
    (unwind-protect
         (progn
           (flush-output c)
           (when (conn-slot c gone)
             (return-from connection-write-segment nil))
           (when (or (null (conn-slot c unsent)) (send-unsent c))
             ;; Nothing queued: straight to the socket.
             (loop while (< (segment-start segment) (segment-end segment))
                   do (multiple-value-bind (n errno)
                          (connection-send c (segment-octets segment)
                                           (segment-start segment) (segment-end segment))
                        (declare (type fixnum n))
                        (cond ((>= n 0)
                               (incf (segment-start segment) n)
                               (incf (the fixnum (conn-slot c sent)) n))
                              ((= errno +eagain+) (return))
                              (t (client-went-away c errno "write"))))))
           (when (< (segment-start segment) (segment-end segment))
             (queue-unsent c segment)
             (setf kept t)))
      (unless kept (free-segment segment))))
  nil)

(defun connection-reserve-output (c n)
  "Room for N octets in C's output buffer, sending what it holds first if
needed: returns the buffer and the index to write at, or NIL if N octets do
not fit even an empty buffer.  The caller fills the buffer from that index
and then calls CONNECTION-COMMIT-OUTPUT with the index after its last octet."
  (declare (type fixnum n))
  (with-connection-slots (out-fill) c
    (let ((buffer (output-buffer c)))
      (declare (type octets buffer))
      (cond ((<= n (- (length buffer) out-fill)) (values buffer out-fill))
            ((<= n (length buffer))
             (flush-output c)
             ;; A fresh buffer when the socket did not take all of the old one.
             (values (output-buffer c) 0))
            (t nil)))))

(declaim (inline connection-commit-output))
(defun connection-commit-output (c fill)
  "The output buffer now holds octets up to FILL (see CONNECTION-RESERVE-OUTPUT)."
  (setf (conn-slot c out-fill) fill))

(defun connection-flush (c)
  "Send everything buffered (what the socket does not take now is queued)."
  (flush-output c))

(defun connection-send-file (c file-fd offset count)
  "Send COUNT bytes of the open file FILE-FD from OFFSET with sendfile(2),
after what is buffered.  What the socket does not take now is queued with a
duplicate of FILE-FD, so the caller may close FILE-FD when this returns."
  (flush-output c)
  (when (conn-slot c gone)
    (return-from connection-send-file))
  (let ((timeout (engine-write-timeout-ms (connection-engine c))))
    (loop while (plusp count)
          do (multiple-value-bind (n errno)
                 (if (and (conn-slot c unsent) (not (send-unsent c)))
                     (values -1 +eagain+) ; queued output waits: as if the socket were full
                     (connection-send-file-chunk c file-fd offset count))
               (cond ((plusp n) (incf offset n) (decf count n)
                      (incf (the fixnum (conn-slot c sent)) n))
                     ((and (minusp n) (= errno +eagain+))
                      (let ((copy (if (conn-slot c raw) -1 (dup-fd file-fd))))
                        (when (>= copy 0)
                          (queue-unsent c (make-segment nil offset (+ offset count) nil copy))
                          (return))
                        ;; A blocking connection (TLS, detached), or no fd to spare.
                        (finish-unsent c)
                        (wait-for-fd c +pollout+ timeout "sendfile")))
                     ((zerop n) (error 'connection-error :stream c :operation "sendfile (file shrank)"))
                     (t (client-went-away c errno "sendfile")))))))

(declaim (inline latin1-octet))
(defun latin1-octet (char)
  "CHAR as a latin-1 octet in a header: ? beyond latin-1, a space for CR, LF
and the other control characters but TAB (RFC 9110, 5.5), so that a header
value cannot inject a header or carry bytes a client must refuse."
  (let ((code (char-code char)))
    (cond ((or (and (< code 32) (/= code 9)) (= code 127)) 32)
          ((< code 256) code)
          (t 63))))

(defun put-latin1 (buffer fill string)
  "Copy STRING into BUFFER at FILL as LATIN1-OCTETs; the index after it.
BUFFER must have room."
  (declare (type octets buffer) (type fixnum fill) (type string string))
  ;; One loop per string representation, so that each reads its characters
  ;; directly instead of through a generic accessor.
  (macrolet ((copy (type)
               `(let ((string string))
                  (declare (type ,type string) (optimize speed (safety 0)))
                  (dotimes (i (length string))
                    (setf (aref buffer (+ fill i)) (latin1-octet (char string i)))))))
    (typecase string
      ((simple-array character (*)) (copy (simple-array character (*))))
      (simple-base-string (copy simple-base-string))
      (t (copy string))))
  (+ fill (length string)))

(defun connection-write-latin1 (c string)
  "Buffer the characters of STRING as LATIN1-OCTETs."
  (declare (type string string))
  (multiple-value-bind (buffer fill) (connection-reserve-output c (length string))
    (if buffer
        (connection-commit-output c (put-latin1 buffer fill string))
        (connection-write-octets c (map 'octets #'latin1-octet string))))
  nil)

(defun connection-write-ascii (c string)
  "Buffer the characters of STRING, all below 128, as octets, unchanged."
  (declare (type simple-string string))
  (with-connection-slots (outbuf out-fill) c
    (let ((n (length string)))
      (declare (type fixnum n))
      (loop with start of-type fixnum = 0
            while (< start n)
            do (when (and outbuf (= out-fill (length (the octets outbuf))))
                 (flush-output c))
               (let ((buffer (output-buffer c)))
                 (declare (type octets buffer))
                 (let* ((fill out-fill)
                        (count (min (- n start) (- (length buffer) fill))))
                   (declare (type fixnum fill count))
                   (macrolet ((copy (type)
                                `(let ((string string))
                                   (declare (type ,type string) (optimize speed))
                                   (dotimes (i count)
                                     (setf (aref buffer (+ fill i))
                                           (logand #xff (char-code (schar string (+ start i)))))))))
                     (if (typep string '(simple-array character (*)))
                         (copy (simple-array character (*)))
                         (copy simple-base-string)))
                   (setf out-fill (+ fill count))
                   (incf start count))))))
  nil)

(defun put-decimal (buffer fill n)
  "The decimal digits of the fixnum N >= 0 into BUFFER at FILL; the index
after them.  BUFFER must have room."
  (declare (type octets buffer) (type fixnum fill) (type (and fixnum unsigned-byte) n)
           (optimize speed))
  (let ((digits (if (zerop n) 1 (loop for m of-type fixnum = n then (floor m 10)
                                      while (plusp m) count t))))
    (declare (type fixnum digits))
    (loop for i of-type fixnum from (+ fill digits -1) downto fill
          do (multiple-value-bind (q r) (floor n 10)
               (setf (aref buffer i) (+ 48 r)
                     n q)))
    (+ fill digits)))

(defun connection-write-decimal (c n)
  "Buffer the decimal digits of the non-negative integer N."
  (declare (type (integer 0) n))
  (multiple-value-bind (buffer fill)
      (and (typep n 'fixnum) (connection-reserve-output c 20)) ; a fixnum has at most 19 digits
    (if buffer
        (connection-commit-output c (put-decimal buffer fill n))
        (connection-write-ascii c (format nil "~D" n)))))
