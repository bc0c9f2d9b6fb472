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
;;;; This file is the connection itself: its class and slots (read through
;;;; CONN-SLOT; the request it serves is a record of its own, request.lisp),
;;;; its counts in its engine's stripe, its buffers and the head budget they
;;;; are charged to, and the wait for its socket.  The files built on it do
;;;; the I/O, with no HTTP/1.1 syntax but in the last: tls-io.lisp (the
;;;; engine's TLS, and the three calls every read and send goes through),
;;;; input.lisp (reads bounded by timeouts), output-queue.lisp and
;;;; output.lisp (writes), http1.lisp (HTTP/1.1's syntax on the connection).
;;;;
;;;; While :ACTIVE, reads block the worker with poll(2) bounded by the
;;;; engine's read timeout; writes do not wait for the client: what the socket
;;;; does not take stays in the connection's output queue, and after the
;;;; answer the connection parks (:PARKED, for EPOLLOUT) until it is sent
;;;; (output-queue.lisp).
;;;; Between requests the layer above calls CONNECTION-MARK-BOUNDARY
;;;; (http1.lisp); the next read then answers end-of-file unless a complete
;;;; request head is already buffered, and records that the connection should
;;;; be parked, so the request loop of the layer above ends and the worker
;;;; returns to the pool (the stream's input methods and CLOSE: stream.lisp).

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

(defun connection-local-address (c)
  (with-connection-slots (local-address local-port fd) c
    (unless local-address
      (multiple-value-setq (local-address local-port) (socket-local-name fd)))
    local-address))

(defun connection-local-port (c)
  (connection-local-address c)
  (conn-slot c local-port))

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

;;; Waiting for the socket

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
