;;;; server.lisp -- running an engine: accepting, dispatching to workers,
;;;; parking, rejecting, timing out and stopping.
;;;;
;;;; Who runs what:
;;;;  - the housekeeper thread accepts (or the layer above accepts and calls
;;;;    ENGINE-ADOPT-FD), writes 503 when the queue is full, drains rejected
;;;;    connections, and every SWEEP-INTERVAL-MS closes parked connections
;;;;    whose deadline passed (408 when part of a head had arrived);
;;;;  - a worker that takes a connection's event reads until the request head
;;;;    is complete, parking the connection again if it is not, then calls the
;;;;    engine's handler, and afterwards parks, closes or leaves the connection
;;;;    (detached) as the handler's use of the stream decided; an answer the
;;;;    socket did not take whole parks the connection for EPOLLOUT first,
;;;;    and the worker that takes that event sends the rest, then goes on
;;;;    (AFTER-WRITE: the next request, or the close).
;;;;
;;;; Every deadline goes into the engine's timing wheel (wheel.lisp); the
;;;; housekeeper advances it every +TICK-MS+ and expires what came due.

(in-package #:gallop.core)

(defconstant +connection-events+ (logior +epollin+ +epollrdhup+ +epollet+)
  "A connection is registered once, edge-triggered: every arrival of input
raises an event, and nothing needs re-arming after a request (see
DISPATCH-EVENT and PARK for how an event that finds the connection busy is
kept).")

(defun make-engine (&key (name "gallop") handler raw
                      (min-threads 4) (max-threads 100) (thread-idle-timeout 10)
                      (header-timeout 20) (idle-timeout 20) (read-timeout 20)
                      (write-timeout 20) handler-timeout (max-head-bytes +default-max-head-bytes+)
                      (max-body-bytes +default-max-body-bytes+)
                      (max-request-line-bytes +default-max-request-line-bytes+)
                      (max-unsent-bytes +default-max-unsent-bytes+) methods (max-queue 1024) (retry-after 1) head-budget thread-starter log-error)
  "Make a stopped engine.  HANDLER is called in a worker as (HANDLER
CONNECTION) once a complete request head is buffered on CONNECTION (or, when
RAW is true, once any bytes arrived: for TLS).  It reads the request from the
connection stream, writes the response, calls CONNECTION-MARK-BOUNDARY between
requests and CLOSE when done.  Timeouts are in seconds: HEADER-TIMEOUT for a
whole request head, IDLE-TIMEOUT between keep-alive requests, READ-TIMEOUT and
WRITE-TIMEOUT for progress while a worker reads a body or writes a response.
HANDLER-TIMEOUT, when given, is a deadline for the handler's whole run on one
request: past it the worker is interrupted with HANDLER-TIMEOUT (the
condition), the client gets 503 if nothing of a response was sent yet, and
the connection is closed.
MAX-HEAD-BYTES and MAX-REQUEST-LINE-BYTES bound a request head (431, 414);
MAX-BODY-BYTES bounds a declared Content-Length (413) and a chunked body.
Output the client does not read yet waits with its connection in epoll, not
in a worker; MAX-UNSENT-BYTES bounds what a streaming writer may leave there
copied before it waits for the client (see connection.lisp).  METHODS, when
given, lists the request methods (keywords, exact case) the handler serves:
others get 501 before it sees them.  MAX-QUEUE bounds the
accepted connections no worker has served yet; beyond it (and the workers
that could still take them) new connections get 503 with Retry-After:
RETRY-AFTER.  HEAD-BUDGET (octets, default a quarter of the heap) bounds the
input buffers of all connections parked with part of a request head, and
every buffer grown for a long head; past it, such a connection gets 503."
  (flet ((ms (seconds) (max 1 (round (* 1000 seconds)))))
    (let ((engine (%make-engine :name name :handler handler :raw-p raw
                                :header-timeout-ms (ms header-timeout)
                                :idle-timeout-ms (ms idle-timeout)
                                :read-timeout-ms (ms read-timeout)
                                :write-timeout-ms (ms write-timeout)
                                :handler-timeout-ms (if handler-timeout (ms handler-timeout) 0)
                                :max-head-bytes max-head-bytes
                                :max-body-bytes max-body-bytes
                                :max-request-line-bytes max-request-line-bytes
                                :max-unsent-bytes max-unsent-bytes
                                :methods methods
                                :max-queue max-queue :retry-after retry-after
                                :head-budget (or head-budget
                                                 (floor (sb-ext:dynamic-space-size) 4))
                                :log-error log-error)))
      (setf (engine-pool engine)
            (make-pool :name name :min-threads min-threads :max-threads max-threads
                       :idle-timeout thread-idle-timeout
                       :thread-starter thread-starter
                       :dispatch (lambda (data flags)
                                   (dispatch-event engine data flags))
                       :log-error (lambda (e)
                                    (log-engine-error engine "Worker error: ~A" e))))
      engine)))

;;; Registering connections

(defun next-token (engine fd)
  ;; 30 bits of generation keep the token a fixnum (see pool.lisp's queue).
  (logior (ash (logand (sb-ext:atomic-incf (engine-generation engine)) #x3fffffff) 32)
          fd))

(defun make-connection (engine fd &key remote-address remote-port close-hook user-data)
  (make-instance 'connection :fd fd :engine engine :token (next-token engine fd)
                             :raw (engine-raw-p engine)
                             :remote-address remote-address :remote-port (or remote-port 0)
                             :close-hook close-hook :user-data user-data))

(defun engine-overloaded-p (engine)
  "True when the accepted connections no worker has served yet fill every
worker that could still take one (idle workers, and those the pool may still
start) plus the queue of MAX-QUEUE: a new connection would only wait, so it
gets 503 at once instead."
  (let ((pool (engine-pool engine)))
    (>= (engine-pending engine)
        (+ (engine-max-queue engine)
           (pool-idle pool)
           (max 0 (- (pool-max-threads pool) (pool-thread-count pool)))))))

(defun engine-adopt-fd (engine fd &key remote-address remote-port close-hook user-data
                                    (nonblocking nil))
  "Take a freshly accepted socket FD into ENGINE: it waits in epoll until its
first request head is complete.  CLOSE-HOOK, if given, is called to release
the fd instead of close(2).  Returns the connection, or NIL if it was refused
(engine not running, fd beyond the table)."
  (unless nonblocking (set-nonblocking fd))
  (when (minusp (engine-listen-fd engine))
    ;; Accepted by the layer above: sockets accepted from the engine's own
    ;; listen socket inherit this from it (ENGINE-START).
    (set-notsent-lowat fd +kernel-unsent-bytes+))
  (let ((table (engine-table engine)))
    (when (or (not (engine-running-p engine)) (>= fd (length table)))
      (if close-hook (funcall close-hook) (close-fd fd))
      (return-from engine-adopt-fd nil))
    (let ((c (make-connection engine fd :remote-address remote-address
                                        :remote-port remote-port
                                        :close-hook close-hook :user-data user-data)))
      (schedule c (+ (now-ms) (engine-header-timeout-ms engine)))
      (sb-ext:atomic-incf (engine-pending engine))
      (sb-ext:atomic-incf (engine-accepted engine))
      (setf (svref table fd) c)
      (multiple-value-bind (ok errno)
          (epoll-ctl (pool-epfd (engine-pool engine)) +epoll-ctl-add+ fd
                     +connection-events+ (connection-token c))
        (unless ok
          (log-engine-error engine "epoll_ctl ADD of fd ~D failed: errno ~D" fd errno)
          (setf (connection-state c) :active)
          (close-connection c)
          (return-from engine-adopt-fd nil)))
      c)))

(defun engine-shed-fd (engine fd &key close-hook)
  "Answer the fresh socket FD with 503 and Retry-After, without a worker, and
close it after the client has read the answer."
  (set-nonblocking fd)
  (sb-ext:atomic-incf (engine-shed engine))
  (sb-ext:atomic-incf (engine-accepted engine))
  (let ((table (engine-table engine)))
    (if (>= fd (length table))
        (if close-hook (funcall close-hook) (close-fd fd))
        (let ((c (make-connection engine fd :close-hook close-hook)))
          (setf (conn-slot c fresh) nil
                (connection-state c) :active
                (svref table fd) c)
          (reject-connection c (response-503 engine) :registered nil)))))

(defun schedule (c deadline)
  "Set C's deadline and make sure the housekeeper looks at C by then."
  (setf (connection-deadline c) deadline)
  (wheel-schedule (engine-wheel (connection-engine c)) c deadline))

(defun unfresh (c)
  (when (conn-slot c fresh)
    (setf (conn-slot c fresh) nil)
    (sb-ext:atomic-decf (engine-pending (connection-engine c)))))

;;; Closing, parking, rejecting

(defun close-connection (c)
  "Close C for good.  The caller owns C (it is :ACTIVE, :DRAINING or
:DETACHED, or the caller won a CAS from :PARKED)."
  (let ((engine (connection-engine c))
        (fd (connection-fd c)))
    (unless (eq (connection-state c) :closed)
      ;; Out of the workers' epoll set before the fd closes.  Since Linux
      ;; 6.10 epoll_wait holds a reference to a ready file while it polls
      ;; it; a close(2) in that instant leaves the last reference, and so
      ;; the socket's release (its FIN), to that worker, which does it only
      ;; on its return to user space, and a worker whose poll found nothing
      ;; sleeps on in epoll_wait (up to the pool's idle timeout, 10 s): the
      ;; client waits that long for an answer or end of file.  EPOLL_CTL_DEL
      ;; waits for such a poll to end, so the close below drops the last
      ;; reference itself.  (Draining, detached and shed connections are not
      ;; in that set.)
      (when (member (connection-state c) '(:active :dirty :parked))
        (let ((epfd (pool-epfd (engine-pool engine))))
          (when (>= epfd 0)
            (epoll-ctl epfd +epoll-ctl-del+ fd 0 0))))
      (unfresh c)
      (uncharge-head c)
      (setf (connection-state c) :closed)
      (wheel-forget c)
      (setf (conn-slot c out-fill) 0
            (conn-slot c in-start) 0
            (conn-slot c in-end) 0)
      (discard-unsent c)
      (release-buffers c)
      (let ((table (engine-table engine)))
        (when (and (< fd (length table)) (eq (svref table fd) c))
          (setf (svref table fd) nil)))
      (let ((hook (conn-slot c close-hook)))
        (if hook
            (handler-case (funcall hook)
              (error (e) (log-engine-error engine "Closing fd ~D: ~A" fd e)))
            (close-fd fd)))
      (sb-ext:atomic-incf (engine-closed engine))))
  nil)

(defun park (c &optional output)
  "Give the connection back to epoll until its next request arrives (OUTPUT:
until the socket takes more of its unsent output, see OUTPUT-PARKED-P).  The
caller owns C.  Returns true, or NIL when an event came while C was busy
(input arrived, or with OUTPUT the socket drained) and marked it :DIRTY: the
caller still owns C and must read (or send) again."
  (let ((engine (connection-engine c)))
    (with-connection-slots (in-start in-end head-started boundary park-requested close-requested) c
      (setf boundary nil park-requested nil close-requested nil)
      (let ((now (now-ms)))
        (cond (output
               ;; The write timeout, from the last time the client read.
               (schedule c (+ (conn-slot c out-progress) (engine-write-timeout-ms engine))))
              ((= in-start in-end)
               (setf head-started nil)
               (schedule c (+ now (engine-idle-timeout-ms engine))))
              (t
               (unless head-started (setf head-started now))
               (schedule c (+ head-started (engine-header-timeout-ms engine))))))
      (release-buffers c)
      (unless (charge-head c)
        ;; Partial heads already hold the engine's whole head budget: this
        ;; one is not kept (the answer is 503, not a crash of the heap; or,
        ;; in the middle of an answer, the end of the connection).
        (sb-ext:atomic-incf (engine-shed engine))
        (if output
            (close-connection c)
            (reject-connection c (response-503 engine)))
        (return-from park t))
      (when (and output (not (conn-slot c out-registered)))
        ;; Once and for good: edge-triggered, EPOLLOUT raises an event only
        ;; when the socket drains after a send found it full.
        (setf (conn-slot c out-registered) t)
        (epoll-ctl (pool-epfd (engine-pool engine)) +epoll-ctl-mod+ (connection-fd c)
                   (logior +connection-events+ +epollout+) (connection-token c)))
      ;; From here on, an event (or the housekeeper, once the deadline
      ;; passes) may take C.  Input that came while C was busy left it
      ;; :DIRTY: keep it and read again, or that input would wait for an
      ;; event that already came.
      (case (sb-ext:compare-and-swap (%conn-slot c state) :active :parked)
        (:active t)
        (:dirty (setf (connection-state c) :active)
         nil)
        (t (error "PARK: ~A is not owned by this worker" c))))))

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

(defun charge-head (c)
  "Count C's input buffer against the head budget if C is about to park with
a partial request in it.  NIL when that would exceed the budget."
  (with-connection-slots (inbuf in-start in-end budgeted engine) c
    (or (null inbuf) (= in-start in-end) (plusp budgeted)
        (let ((n (length (the octets inbuf))))
          (if (> (+ n (sb-ext:atomic-incf (engine-head-bytes engine) n))
                 (engine-head-budget engine))
              (progn (sb-ext:atomic-decf (engine-head-bytes engine) n) nil)
              (progn (setf budgeted n) t))))))

(defun uncharge-head (c)
  "C gives its input buffer up (rejected or closed): give its share of the
budget back."
  (with-connection-slots (budgeted engine) c
    (when (plusp budgeted)
      (sb-ext:atomic-decf (engine-head-bytes engine) budgeted)
      (setf budgeted 0))))

(defun reject-connection (c response &key (registered t))
  "Send RESPONSE (an error the engine writes itself; NIL: nothing more), shut
the write side and let the housekeeper drain and close C.  The caller owns C."
  (let* ((engine (connection-engine c))
         (fd (connection-fd c)))
    (unfresh c)
    (uncharge-head c)
    (discard-unsent c)
    (when registered
      (epoll-ctl (pool-epfd (engine-pool engine)) +epoll-ctl-del+ fd 0 0))
    (when response
      (send-from fd response 0 (length response)))
    (shutdown-fd fd +shut-wr+)
    (with-connection-slots (in-start in-end out-fill) c
      (setf in-start 0 in-end 0 out-fill 0))
    (release-buffers c)
    (schedule c (+ (now-ms) (engine-linger-ms engine)))
    (setf (connection-state c) :draining)
    (unless (and (>= (engine-housekeeper-epfd engine) 0)
                 (epoll-ctl (engine-housekeeper-epfd engine) +epoll-ctl-add+ fd
                            (logior +epollin+ +epollrdhup+) (connection-token c)))
      (close-connection c))))

;;; Serving

(defun dispatch-event (engine token flags)
  "Called in a worker for an epoll event on a connection, with the event's
FLAGS."
  (let* ((fd (logand token #xffffffff))
         (table (engine-table engine))
         (c (and (< fd (length table)) (svref table fd))))
    (when (and c (= (connection-token c) token))
      (when (logtest flags (logior +epollrdhup+ +epollhup+ +epollerr+))
        ;; The client half-closed (or the socket failed): the end of file
        ;; is already there, and no further event will announce it.
        (setf (conn-slot c peer-closed) t))
      (loop
        (case (sb-ext:compare-and-swap (%conn-slot c state) :parked :active)
          (:parked
           (return
             (handler-case (serve-connection engine c)
               (serious-condition (e)
                 ;; A bug, not the client's doing: log it, and don't leak the fd.
                 (log-engine-error engine "Internal error serving ~A: ~A" c e)
                 (unless (member (connection-state c) '(:closed :detached :draining))
                   (close-connection c))))))
          (:active
           ;; Busy: tell its owner, who reads again instead of parking.
           (when (eq :active (sb-ext:compare-and-swap (%conn-slot c state) :active :dirty))
             (return)))
          (t (return)))))))

(defun error-response (status)
  (ecase status
    (400 +response-400+) (413 +response-413+) (414 +response-414+)
    (431 +response-431+) (501 +response-501+) (505 +response-505+)))

(defun serve-connection (engine c)
  "Read until a request head is complete, check it, run the handler; then
park, close or leave C as the handler decided.  A further request already
buffered (pipelining) waits its turn behind other ready connections
(YIELD-TURN), and none is read while an answer is unsent.  The caller owns C."
  (unfresh c)
  (setf (conn-slot c waiting-turn) nil)
  (when (or (conn-slot c unsent) (conn-slot c suspended))
    ;; Back from waiting for the client to read the last answer.
    (when (output-parked-p c)
      (return-from serve-connection))
    (when (conn-slot c suspended)
      ;; Sent for a request answered from another thread: C is that
      ;; thread's again (CONNECTION-ACQUIRE).
      (setf (conn-slot c out-parked) nil)
      (return-from serve-connection))
    (when (eq (shiftf (conn-slot c after-write) nil) :close)
      (return-from serve-connection (close-after-answer c))))
  ;; C keeps its share of the head budget while this worker reads into its
  ;; buffer: buffers being read count as much as parked ones.
  (with-connection-slots (fd in-end raw) c
    (flet ((head-ready-p ()
             ;; A complete head is buffered; a head over a limit is refused
             ;; at once, complete or not.
             (ecase (scan-head c)
               (:complete t)
               (:incomplete nil)
               (:line-too-long (return-from serve-connection (reject c +response-414+)))
               (:too-large (return-from serve-connection (reject c +response-431+))))))
      (loop
        (let ((ready (if raw (< (conn-slot c in-start) in-end) (head-ready-p))))
          (unless ready
            (unless (make-room c (engine-max-head-bytes engine))
              ;; Full: at the head limit (431), or short of it because the
              ;; head budget is spent (503).
              (return (if (< (length (the octets (conn-slot c inbuf)))
                             (engine-max-head-bytes engine))
                          (progn (sb-ext:atomic-incf (engine-shed engine))
                                 (reject-connection c (response-503 engine)))
                          (reject c +response-431+))))
            (let ((buffer (conn-slot c inbuf)))
              (multiple-value-bind (n errno) (read-into fd buffer in-end (length buffer))
                (setf (conn-slot c drained) (< n (- (length buffer) in-end)))
                (cond ((plusp n)
                       (incf in-end n)
                       (setf ready (or raw (head-ready-p))))
                      ((zerop n) (return (close-connection c)))
                      ((= errno +eagain+) (when (park c) (return)))
                      (t (return (close-connection c)))))))
          (when ready
            (unless raw
              (let ((refusal (check-head c)))
                (when refusal
                  (return (reject c (error-response refusal)))))
              (begin-message c))
            (ecase (run-handler engine c)
              (:park
               (unless (and (engine-running-p engine) (not (conn-slot c close-after))
                            (finish-message c))
                 (return (close-after-answer c)))
               (when (conn-slot c unsent)
                 ;; The client has not read this answer yet: no further
                 ;; request is read until it has (pipelining backpressure).
                 (setf (conn-slot c after-write) :serve)
                 (when (output-parked-p c)
                   (return)))
               (when (and (not raw) (< (conn-slot c in-start) in-end)
                          (yield-turn c))
                 ;; The next pipelined request waits its turn.
                 (return))
               ;; Nothing buffered: park without trying another read.
               ;; Most clients send their next request only after this
               ;; answer, so that read would nearly always fail with
               ;; EAGAIN; input that came meanwhile raised an event that
               ;; left C :DIRTY, and PARK then says to read.  Only when
               ;; the last read left input behind (a full buffer), or
               ;; the client half-closed (its end of file raised no
               ;; event of its own), is the read needed.
               (when (and (not raw) (= (conn-slot c in-start) in-end)
                          (conn-slot c drained) (not (conn-slot c peer-closed))
                          (park c))
                 (return)))
              (:close (return (close-after-answer c)))
              (:detached (return))
              (:suspended
               ;; Let go of C: its answering thread takes it (CONNECTION-ACQUIRE).
               (return (connection-release c))))))))))

(defun yield-turn (c)
  "C has served a request and has the next one buffered (pipelining): let it
wait its turn behind the other ready connections, as nginx does, instead of
serving a client's pipelined requests for as long as it sends them while
new clients wait.  C is parked with its input and queued for a worker (see
POOL-REQUEUE).  True when C was given up, NIL when an event marked it :DIRTY
meanwhile: the caller still owns C and goes on serving it."
  (setf (conn-slot c waiting-turn) t)
  (cond ((park c)
         (pool-requeue (engine-pool (connection-engine c)) (connection-token c))
         t)
        (t (setf (conn-slot c waiting-turn) nil)
           nil)))

(defun output-parked-p (c)
  "C has unsent output (connection.lisp, Output): send what the socket takes
now, and park C in epoll until it takes more if some is left; a worker then
comes back to SERVE-CONNECTION.  True when C was parked or closed (the caller
lets go of C), NIL when all of it is sent and the caller still owns C."
  (handler-case
      (loop (when (send-unsent c)
              (return nil))
            (when (park c t)
              (return t)))
    (connection-error ()
      (note-client-abort (connection-engine c))
      (close-connection c)
      t)))

(defun close-after-answer (c)
  "Close C after its last answer, once the client read it (until then C waits
in epoll, see OUTPUT-PARKED-P): at once when the client sent nothing more,
else after reading and discarding what it still sends for a while (LINGER-MS:
a close(2) with unread input sends a reset, which can destroy the answer
before the client read it).  A raw (TLS) connection always lingers: what
the client sent is not known here, and a TLS client sends its close_notify
alert, data, as soon as it is done, often before the answer came."
  (when (conn-slot c unsent)
    (setf (conn-slot c after-write) :close)
    (when (output-parked-p c)
      (return-from close-after-answer)))
  (if (and (not (conn-slot c raw))
           (finish-message c) (= (conn-slot c in-start) (conn-slot c in-end)))
      (close-connection c)
      (reject-connection c nil)))

(defun connection-suspend (c)
  "Called by a handler, in its worker, that will answer later from another
thread; the handler then returns :SUSPENDED and the worker leaves C to that
thread, which writes between CONNECTION-ACQUIRE and CONNECTION-RELEASE and
ends with CONNECTION-RESUME.  The request counts as in flight until then.
The handler deadline ends here: no interrupt may reach the worker once it is
handing C over."
  (sb-sys:without-interrupts
    (disarm-handler-deadline c)
    (setf (conn-slot c suspended) t
          (conn-slot c out-parked) t)   ; the worker's until it lets go
    (sb-ext:atomic-incf (engine-in-flight (connection-engine c)))))

(defun connection-unsuspend (c)
  "Undo CONNECTION-SUSPEND before the handler returned (the answer came first)."
  (setf (conn-slot c suspended) nil
        (conn-slot c out-parked) nil)
  (end-in-flight (connection-engine c)))

;;; A suspended request's connection changes hands between its answering
;;; thread, which writes, and the engine, which sends what the client did not
;;; read yet while the connection waits in epoll.  OUT-PARKED says which:
;;; while it is true the engine owns C (:PARKED, or :ACTIVE in the worker
;;; sending for it); the answering thread takes C back with a CAS from
;;; :PARKED, or once the worker has cleared OUT-PARKED, its last act on C.

(defun connection-acquire (c)
  "Called by the thread answering a suspended request on C before it writes:
wait until the engine is not sending C's unsent output (it never waits for
the client: only for a worker's non-blocking send), and take C.  NIL when C
was closed meanwhile (the client went away, or read nothing for the write
timeout): there is nobody to answer."
  (loop
    (case (connection-state c)
      ((:active :dirty)
       (unless (conn-slot c out-parked)
         (return t)))
      (:parked
       (when (eq :parked (sb-ext:compare-and-swap (%conn-slot c state) :parked :active))
         (setf (conn-slot c out-parked) nil)
         (return t)))
      (t (return nil)))
    (sb-thread:thread-yield)))

(defun connection-release (c)
  "Called by the thread owning C while its request is suspended, after it
wrote: what the client did not read yet is left to the engine, which sends
it from epoll (OUTPUT-PARKED-P); C goes back to the answering thread at the
next CONNECTION-ACQUIRE."
  (setf (conn-slot c out-parked) t)
  (unless (output-parked-p c)
    (setf (conn-slot c out-parked) nil))
  nil)

(defun connection-resume (c keep-alive)
  "Finish a suspended request from the thread that answered it, which owns C
\(CONNECTION-ACQUIRE): when KEEP-ALIVE, give C back to the engine (a worker
serves its next request, never this thread, which may be an application's
timer or broadcaster), else close it (after the client read the answer)."
  (let ((engine (connection-engine c)))
    (end-in-flight engine)
    (when (member (connection-state c) '(:closed :draining :detached))
      (return-from connection-resume))
    (setf (conn-slot c suspended) nil
          (conn-slot c out-parked) nil)
    (if (and keep-alive (engine-running-p engine) (not (conn-slot c close-after))
             (finish-message c))
        (handler-case (if (conn-slot c unsent)
                          ;; Parks C until the client read it (or sends it).
                          (serve-connection engine c)
                          ;; A worker serves what comes next: C waits in
                          ;; epoll, or when input may be there already, in
                          ;; the pool's queue (as in SERVE-CONNECTION).
                          (unless (and (= (conn-slot c in-start) (conn-slot c in-end))
                                       (conn-slot c drained) (not (conn-slot c peer-closed))
                                       (park c))
                            (loop until (yield-turn c))))
          (serious-condition (e)
            (log-engine-error engine "Error resuming ~A: ~A" c e)
            (unless (member (connection-state c) '(:closed :detached :draining))
              (close-connection c))))
        (close-after-answer c))))

(defun reject (c response)
  (sb-ext:atomic-incf (engine-rejected (connection-engine c)))
  (reject-connection c response))

(defvar *handler-connection* nil
  "In a worker, while it runs the engine's handler: the connection served.
A deadline interrupt acts only while this is bound to its connection.")

(defun arm-handler-deadline (c)
  "Note that this thread now runs the handler on C, and start C's handler
deadline, if the engine has one."
  (let ((timeout (engine-handler-timeout-ms (connection-engine c))))
    (setf (conn-slot c sent) 0
          (conn-slot c handler-serial) (logand (1+ (conn-slot c handler-serial))
                                                 most-positive-fixnum))
    ;; The deadline first: an older entry due now must not find this thread
    ;; marked as running the handler with an old deadline.
    (when (plusp timeout)
      (schedule c (+ (now-ms) timeout)))
    (setf (conn-slot c handler-thread) sb-thread:*current-thread*)))

(defun disarm-handler-deadline (c)
  "This thread no longer runs the handler on C.  Clears only this thread's
mark: after a hand-off (CONNECTION-SUSPEND) another thread may own C."
  (sb-ext:compare-and-swap (%conn-slot c handler-thread) sb-thread:*current-thread* nil))

(defun interrupt-handler (c thread serial seconds)
  "Make THREAD, if it still runs handler run number SERIAL on C, signal
HANDLER-TIMEOUT (SECONDS NIL: the server is stopping).  Any thread."
  (sb-thread:interrupt-thread
   thread
   (lambda ()
     ;; Runs in THREAD, at whatever it was doing: act only inside the
     ;; handler run meant, never in the worker's own bookkeeping.
     (when (and (eq *handler-connection* c)
                (eql (conn-slot c handler-serial) serial)
                (eq (conn-slot c handler-thread) sb-thread:*current-thread*))
       (setf (conn-slot c interrupted) t)
       ;; ERROR, not SIGNAL: unless something in the handler unwinds it,
       ;; RUN-HANDLER's HANDLER-CASE does.
       (error 'handler-timeout :seconds seconds)))))

(defun answer-interrupted-handler (engine c condition)
  "After HANDLER-TIMEOUT cut a handler short: log CONDITION (NIL: the layer
above caught and logged it), and answer 503 if no byte of a response went
out yet.  Over TLS the engine can't write for the handler: its layer answers."
  (when condition
    (log-engine-error engine "~A (~A)" condition c))
  (when (and (zerop (the fixnum (conn-slot c sent))) (not (engine-raw-p engine)))
    (setf (conn-slot c out-fill) 0)
    (let ((response (response-503 engine)))
      ;; After what is queued (an interim 100 Continue), never before it.
      (ignore-errors (send-all c response 0 (length response) :reference)))))

(defun run-handler (engine c)
  "Run the engine's handler on C.  Any serious condition the handler lets
escape (an error, or SBCL's control stack exhaustion, which is a
STORAGE-CONDITION, not an ERROR) is logged and closes C: it must never reach
the worker's thread, where it would kill the process or park the thread in
the debugger.  A handler cut short by its deadline closes C too, after a 503
if it had not answered.  Returns :PARK (the handler is done with this request
and the connection may serve another), :CLOSE, :DETACHED (the handler kept
the stream) or :SUSPENDED (the handler returned :SUSPENDED after
CONNECTION-SUSPEND: another thread will finish the request)."
  (with-connection-slots (boundary park-requested close-requested head-started sent interrupted) c
    (setf boundary nil park-requested nil close-requested nil head-started nil
          sent 0 interrupted nil (conn-slot c body-given) nil)
    (sb-ext:atomic-incf (engine-requests engine))
    (sb-ext:atomic-incf (engine-in-flight engine))
    (arm-handler-deadline c)
    (let ((result
            (unwind-protect
                 (handler-case (let ((*handler-connection* c))
                                 (funcall (the function (engine-handler engine)) c))
                   (handler-timeout (e)
                     (answer-interrupted-handler engine c e)
                     (setf interrupted :answered)
                     nil)
                   (connection-error (e)
                     ;; The client went away or stalled (timeouts are
                     ;; counted where they happen): close, quietly.
                     (unless (typep e 'connection-timeout-error)
                       (note-client-abort engine))
                     (setf close-requested t park-requested nil)
                     nil)
                   (serious-condition (e)
                     (log-engine-error engine "Error serving ~A: ~A" c e)
                     (setf close-requested t park-requested nil)
                     nil))
              (disarm-handler-deadline c)
              (end-in-flight engine))))
      (when (eq result :suspended)
        ;; Another thread owns C now (see CONNECTION-SUSPEND): hands off.
        (return-from run-handler :suspended)))
    (when interrupted
      (unless (eq interrupted :answered)
        ;; The layer above caught HANDLER-TIMEOUT itself (Hunchentoot's
        ;; PROCESS-CONNECTION makes it an error it logs): still answer.
        (answer-interrupted-handler engine c nil))
      (setf close-requested t park-requested nil))
    (cond ((not close-requested)
           ;; The handler kept the stream: it is an ordinary stream from now
           ;; on, with no more events.  Unregister before anyone else may
           ;; close it (and the fd number be reused by a new connection).
           (epoll-ctl (pool-epfd (engine-pool engine)) +epoll-ctl-del+ (connection-fd c) 0 0)
           (setf boundary nil park-requested nil
                 (connection-state c) :detached)
           ;; Its owner writes with blocking sends from now on: what is
           ;; queued (the answer that switched protocols) goes first.
           (when (conn-slot c unsent)
             (handler-case (finish-unsent c)
               (connection-error () (discard-unsent c))))
           :detached)
          (park-requested :park)
          (t :close))))

;;; The housekeeper

(defun accept-pending (engine)
  "Accept every connection waiting on the listen socket."
  (loop repeat 512
        do (multiple-value-bind (fd address-or-errno port) (accept-connection (engine-listen-fd engine))
             (cond ((>= fd 0)
                    (if (engine-overloaded-p engine)
                        (engine-shed-fd engine fd)
                        (engine-adopt-fd engine fd :remote-address address-or-errno
                                                   :remote-port port :nonblocking t)))
                   ((= address-or-errno +eagain+) (return))
                   ((member address-or-errno (list +emfile+ +enfile+))
                    ;; Out of fds: stop accepting until the next tick (some may be free by then).
                    (let ((now (now-ms)))
                      (when (> (- now (engine-last-emfile-ms engine)) 10000)
                        (setf (engine-last-emfile-ms engine) now)
                        (log-engine-error engine "accept: out of file descriptors (errno ~D); ~
                                                  pausing accepts" address-or-errno)))
                    (epoll-ctl (engine-housekeeper-epfd engine) +epoll-ctl-del+
                               (engine-listen-fd engine) 0 0)
                    (return :paused))
                   (t (return))))))

(defun drain (engine token)
  (let* ((fd (logand token #xffffffff))
         (table (engine-table engine))
         (c (and (< fd (length table)) (svref table fd))))
    (when (and c (= (connection-token c) token) (eq (connection-state c) :draining))
      (let ((scratch (ensure-inbuf c)))
        (loop
          (multiple-value-bind (n errno) (read-into fd scratch 0 (length scratch))
            (cond ((plusp n))
                  ((and (minusp n) (= errno +eagain+)) (return))
                  (t (close-connection c) (return)))))
        (when (conn-slot c inbuf) (release-buffers c))))))

(defun expire (engine c now)
  "The wheel brought C up at NOW: close it if its deadline passed (with 408
when part of a request head had arrived), else schedule it again."
  (flet ((due-p () (<= (connection-deadline c) now)))
    (case (connection-state c)
      (:parked
       (cond ((not (due-p))
              (wheel-schedule (engine-wheel engine) c (connection-deadline c)))
             ((eq (sb-ext:compare-and-swap (%conn-slot c state) :parked :active) :parked)
              (cond ((conn-slot c unsent)
                     ;; The client read nothing of its answer for the write
                     ;; timeout (a slow-read attack, or a dead peer).
                     (sb-ext:atomic-incf (engine-timeouts engine))
                     (sb-ext:atomic-incf (engine-write-timeouts engine))
                     (close-connection c))
                    ((conn-slot c head-started)
                     (sb-ext:atomic-incf (engine-timeouts engine))
                     (reject c +response-408+))
                    ((conn-slot c fresh)
                     ;; Connected but never sent a byte in time.
                     (sb-ext:atomic-incf (engine-timeouts engine))
                     (close-connection c))
                    (t (close-connection c))))))
      (:draining
       (if (due-p)
           (close-connection c)
           (wheel-schedule (engine-wheel engine) c (connection-deadline c))))
      ((:active :dirty)
       (let ((thread (conn-slot c handler-thread))
             (serial (conn-slot c handler-serial)))
         (if (and thread (plusp (engine-handler-timeout-ms engine)) (due-p))
             ;; A handler deadline (see ARM-HANDLER-DEADLINE).
             (handler-case
                 (interrupt-handler c thread serial
                                    (/ (engine-handler-timeout-ms engine) 1000.0))
               (error (e) (log-engine-error engine "Interrupting ~A: ~A" thread e)))
             ;; Keep the entry: the owner may just have set a deadline that
             ;; this entry stood for (PARK, REJECT-CONNECTION and
             ;; ARM-HANDLER-DEADLINE only push an entry when it is earlier
             ;; than the one there), and it must still be looked at then.
             (wheel-schedule (engine-wheel engine) c
                             (max (connection-deadline c) (+ now +tick-ms+)))))))))

(defun close-idle-connections (engine &key keep-readable)
  "Close every parked and draining connection; with KEEP-READABLE, leave the
parked ones whose client already sent more (in the socket, or buffered
and waiting its turn), for a worker to serve, and those whose client is
still reading an answer.  Returns
how many parked connections were left.  Used by ENGINE-STOP, once the
housekeeper has exited."
  (let ((left 0))
    (loop for c across (engine-table engine)
          when c
            do (case (connection-state c)
                 (:parked
                  (if (and keep-readable
                           (or (conn-slot c unsent) ; an answer the client is still reading
                               (conn-slot c waiting-turn) ; a request it sent, not served yet
                               (eq :ready (poll-fds (connection-fd c) +pollin+ -1 0))))
                      (incf left)
                      (when (eq (sb-ext:compare-and-swap (%conn-slot c state) :parked :active)
                                :parked)
                        (close-connection c))))
                 (:draining (close-connection c))))
    left))

(defconstant +soft-stop-input-grace-ms+ 1000
  "How long a soft stop keeps serving requests that clients had already sent
on idle keep-alive connections when it began.")

(defun housekeeper-loop (engine)
  (let ((events (make-event-buffer 64))
        (epfd (engine-housekeeper-epfd engine))
        (wheel (engine-wheel engine))
        (next-tick 0)
        (accept-paused nil))
    (unwind-protect
         (loop
           (let ((n (epoll-wait epfd events 64 +tick-ms+)))
             (dotimes (i n)
               (let ((data (event-data events i)))
                 (cond ((= data +stop-data+)
                        (return-from housekeeper-loop))
                       ((= data +listen-data+)
                        (when (eq (accept-pending engine) :paused)
                          (setf accept-paused t)))
                       (t (drain engine data)))))
             (let ((now (now-ms)))
               (when (>= now next-tick)
                 (setf next-tick (+ now +tick-ms+))
                 (handler-case (wheel-advance wheel now (lambda (c) (expire engine c now)))
                   (error (e) (log-engine-error engine "Timer error: ~A" e)))
                 (when accept-paused
                   (setf accept-paused nil)
                   (epoll-ctl epfd +epoll-ctl-add+ (engine-listen-fd engine)
                              +epollin+ +listen-data+))))))
      (free-event-buffer events))))

;;; Start and stop

(defun engine-start (engine &key listen-fd)
  "Start ENGINE's pool and housekeeper.  With LISTEN-FD, the housekeeper
accepts on it (it is made non-blocking); without, the layer above accepts and
calls ENGINE-ADOPT-FD."
  (assert (eq (engine-state engine) :stopped))
  (let ((limit (raise-fd-limit)))
    (when (< limit 10000)
      (log-engine-error engine "The fd limit (RLIMIT_NOFILE) is ~D and could not be ~
                                raised: at most about ~D connections." limit limit))
    (setf (engine-table engine) (make-array limit :initial-element nil)))
  (setf (engine-wheel engine) (make-wheel)
        (engine-housekeeper-epfd engine) (epoll-create)
        (engine-stop-fd engine) (make-eventfd)
        (engine-listen-fd engine) (or listen-fd -1))
  (epoll-ctl (engine-housekeeper-epfd engine) +epoll-ctl-add+ (engine-stop-fd engine)
             +epollin+ +stop-data+)
  (when listen-fd
    (set-nonblocking listen-fd)
    ;; Inherited by every socket accepted from it: no system call per accept.
    (set-notsent-lowat listen-fd +kernel-unsent-bytes+)
    (epoll-ctl (engine-housekeeper-epfd engine) +epoll-ctl-add+ listen-fd
               +epollin+ +listen-data+))
  (pool-start (engine-pool engine))
  (setf (engine-state engine) :running)
  (setf (engine-housekeeper engine)
        (start-pool-thread (engine-pool engine) (lambda () (housekeeper-loop engine))
                           (format nil "~A-housekeeper" (engine-name engine))))
  engine)

(defun wait-for-in-flight (engine &optional timeout-ms)
  "Wait until no request is in flight, or TIMEOUT-MS passed.  True if none is."
  (let ((end (and timeout-ms (+ (now-ms) timeout-ms))))
    (loop until (zerop (engine-in-flight engine))
          do (when (and end (>= (now-ms) end))
               (return-from wait-for-in-flight nil))
             ;; Woken by END-IN-FLIGHT; the timeout only bounds a missed wake-up.
             ;; (CONDITION-WAIT returns without the mutex when it times out.)
             (sb-thread:with-mutex ((engine-lock engine))
               (when (plusp (engine-in-flight engine))
                 (unless (sb-thread:condition-wait (engine-idle-queue engine)
                                                   (engine-lock engine) :timeout 0.1)
                   (sb-thread:grab-mutex (engine-lock engine)))))))
  t)

(defconstant +hard-stop-grace-ms+ 1000
  "How long a hard stop waits for handlers after cutting their sockets,
before it interrupts the ones still running.")

(defun interrupt-running-handlers (engine)
  "Signal HANDLER-TIMEOUT in every worker still running a handler."
  (loop for c across (engine-table engine)
        when c
          do (let ((thread (conn-slot c handler-thread))
                   (serial (conn-slot c handler-serial)))
               (when (and thread (member (connection-state c) '(:active :dirty)))
                 (log-engine-error engine "Stopping: interrupting the handler of ~A" c)
                 (ignore-errors (interrupt-handler c thread serial nil))))))

(defun engine-stop (engine &key soft)
  "Stop ENGINE: stop accepting, close idle connections, let in-flight requests
finish (when SOFT: with those already sent on idle connections, answered
with Connection: close) or cut their sockets (otherwise; handlers still running a
second later are interrupted with HANDLER-TIMEOUT), and join every thread.
Connections a handler detached are left to it.  The listen socket itself
belongs to the caller, who closes it afterwards."
  (when (eq (engine-state engine) :running)
    (setf (engine-state engine) :stopping)
    (signal-eventfd (engine-stop-fd engine))
    (when (engine-housekeeper engine)
      (sb-thread:join-thread (engine-housekeeper engine) :default nil)
      (setf (engine-housekeeper engine) nil))
    (cond (soft
           ;; A request that arrived on an idle connection just before the
           ;; stop is served (with Connection: close) rather than cut off:
           ;; close only the idle connections with nothing to read, until
           ;; the others were served or the grace ran out.
           (let ((end (+ (now-ms) +soft-stop-input-grace-ms+)))
             (loop while (and (plusp (close-idle-connections engine :keep-readable t))
                              (< (now-ms) end))
                   do (sleep 0.005)))
           (close-idle-connections engine)
           (wait-for-in-flight engine))
          (t
           (close-idle-connections engine)
           (loop for c across (engine-table engine)
                 when (and c (member (connection-state c) '(:active :dirty)))
                   do (shutdown-fd (connection-fd c) +shut-rdwr+))
           ;; A handler that is not reading or writing (sleeping, computing,
           ;; waiting on a database) didn't notice: interrupt it.
           (unless (wait-for-in-flight engine +hard-stop-grace-ms+)
             (interrupt-running-handlers engine))))
    (pool-stop (engine-pool engine))
    ;; Workers that finished after the first pass closed their connections
    ;; instead of parking them; catch any that raced with it.
    (close-idle-connections engine)
    (close-fd (engine-housekeeper-epfd engine))
    (close-fd (engine-stop-fd engine))
    (setf (engine-housekeeper-epfd engine) -1
          (engine-stop-fd engine) -1
          (engine-listen-fd engine) -1
          (engine-state engine) :stopped))
  engine)
