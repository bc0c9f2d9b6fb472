;;;; server.lisp -- making, starting and stopping an engine; its stats.
;;;;
;;;; Who runs what:
;;;;  - the housekeeper thread (housekeeper.lisp) accepts (or the layer above
;;;;    accepts and calls ENGINE-ADOPT-FD, accept.lisp), writes 503 when the
;;;;    queue is full, drains rejected connections, and closes parked
;;;;    connections whose deadline passed;
;;;;  - a worker of the pool (pool/worker.lisp) that takes a connection's event
;;;;    serves it (serve.lisp), running the engine's handler (handler.lisp);
;;;;  - a connection's states: lifecycle.lisp; the head budget:
;;;;    connection.lisp.

(in-package #:gallop.core)

(define-settings-function make-engine ()
    ((name "gallop") handler raw tls-context methods (retry-after 1) thread-starter log-error
     log-answer)
  "Make a stopped engine, with the settings of +SETTINGS+ (settings.lisp).  HANDLER is called in a worker as (HANDLER
CONNECTION) once a complete request head is buffered on CONNECTION (or, when
RAW is true, once any bytes arrived: for TLS through a library above the
engine).  TLS-CONTEXT (MAKE-TLS-CONTEXT) makes every connection TLS, on the
engine's own event loop: the handshake, request heads and idle keep-alive
connections wait in epoll as plain ones do, and the handler reads and writes
plaintext.  It reads the request from the
connection stream, writes the response, calls CONNECTION-MARK-BOUNDARY between
requests, and returns what becomes of the connection: :KEEP-ALIVE (done with
this request: a read after the boundary answered end of file), :CLOSE,
:DETACHED (it keeps the stream) or :SUSPENDED (see RUN-HANDLER).  Timeouts are in seconds: HEADER-TIMEOUT for a
whole request head, IDLE-TIMEOUT between keep-alive requests, READ-TIMEOUT and
WRITE-TIMEOUT for progress while a worker reads a body or writes a response.
HANDLER-TIMEOUT, when given, is a deadline for the handler's whole run on one
request: past it the worker is interrupted with HANDLER-TIMEOUT (the
condition), the client gets 503 if nothing of a response was sent yet, and
the connection is closed.
MAX-HEAD-BYTES and MAX-REQUEST-LINE-BYTES bound a request head (431, 414);
MAX-BODY-BYTES bounds a declared Content-Length (413) and a chunked body.
Output the client does not read yet waits with its connection in epoll, not
in a worker; past MAX-UNSENT-BYTES, what a streaming writer leaves there is
charged to the memory account, and when the account refuses, at most
MAX-WAITING-WRITERS writers wait for their clients (see output-queue.lisp).  METHODS, when
given, lists the request methods (keywords, exact case) the handler serves:
others get 501 before it sees them.  MAX-QUEUE-LENGTH bounds the
accepted connections no worker has served yet; beyond it (and the workers
that could still take them) new connections get 503 with Retry-After:
RETRY-AFTER.  HEAD-BUDGET (octets, default a quarter of the heap) bounds the
input buffers of all connections parked with part of a request head, and
every buffer grown for a long head; past it, such a connection gets 503.
LOG-ERROR is called as FORMAT is, for the engine's own errors; LOG-ANSWER,
when given, for each answer the engine writes itself (400, 408, 413, 414,
431, 501, 505, 503), with what is known of its request (see NOTE-REFUSAL)."
  (flet ((ms (seconds) (max 1 (round (* 1000 seconds)))))
    (let ((engine (%make-engine :name name :handler handler :raw-p raw :tls tls-context
                                :header-timeout-ms (ms header-timeout)
                                :idle-timeout-ms (ms idle-timeout)
                                :read-timeout-ms (ms read-timeout)
                                :write-timeout-ms (ms write-timeout)
                                :handler-timeout-ms (if handler-timeout (ms handler-timeout) 0)
                                :stop-timeout-ms (ms stop-timeout)
                                :stop-idle-grace-ms (ms stop-idle-grace)
                                :max-head-bytes max-head-bytes
                                :max-body-bytes max-body-bytes
                                :max-request-line-bytes max-request-line-bytes
                                :max-unsent-bytes max-unsent-bytes
                                :max-waiting-writers (max 1 (or max-waiting-writers
                                                                (ceiling (usable-cpus))))
                                :upgraded-idle-ms (if upgraded-idle-timeout
                                                      (ms upgraded-idle-timeout)
                                                      0)
                                :upgraded-send-limit upgraded-send-limit
                                :max-switched (or max-switched-threads most-positive-fixnum)
                                :methods methods
                                :max-queue max-queue-length :retry-after retry-after
                                :head-budget (or head-budget
                                                 (floor (sb-ext:dynamic-space-size) 4))
                                :body-buffer-bytes body-buffer-bytes
                                :body-budget (or body-budget
                                                 (floor (sb-ext:dynamic-space-size) 8))
                                :disk-budget body-disk-budget
                                :temp-directory (temp-directory-name body-temp-directory)
                                :streamed-bodies (and streamed-bodies
                                                      (coerce streamed-bodies 'function))
                                :min-rate (if min-data-rate (round min-data-rate) 0)
                                :rate-grace-ms (ms min-data-rate-grace)
                                :log-error log-error
                                :log-answer (and log-answer (coerce log-answer 'function)))))
      (setf (engine-pool engine)
            (make-pool :name name
                       :standby-threads (max 1 (min standby-thread-count max-thread-count))
                       :max-threads max-thread-count
                       :thread-idle-timeout thread-idle-timeout
                       :thread-starter thread-starter
                       :dispatch (lambda (data flags)
                                   (dispatch-event engine data flags))
                       :log-error (lambda (e)
                                    (log-engine-error engine "Worker error: ~A" e))))
      engine)))


;;; Start and stop

(defun engine-start (engine &key listen-fd own-listener)
  "Start ENGINE's pool and housekeeper.  With LISTEN-FD, the housekeeper
accepts on it (it is made non-blocking); without, the layer above accepts and
calls ENGINE-ADOPT-FD.  OWN-LISTENER: LISTEN-FD is the engine's to end, not
shared with a supervisor that keeps it for the next process, so a soft stop
empties its queue and shuts it (FINAL-ACCEPT)."
  (assert (eq (engine-state engine) :stopped))
  (let ((limit (raise-fd-limit)))
    (when (< limit 10000)
      (log-engine-error engine "The fd limit (RLIMIT_NOFILE) is ~D and could not be ~
                                raised: at most about ~D connections." limit limit))
    (setf (engine-table engine) (make-array limit :initial-element nil)))
  (setf (engine-wheel engine) (make-wheel)
        (engine-housekeeper-epfd engine) (epoll-create)
        (engine-stop-fd engine) (make-eventfd)
        (engine-listen-fd engine) (or listen-fd -1)
        (engine-own-listener engine) (and listen-fd own-listener t)
        (engine-final-accept engine) nil
        (engine-accepting-ended engine) nil
        (engine-housekeeper-exit engine) nil
        (engine-draining engine) nil)
  (epoll-ctl (engine-housekeeper-epfd engine) +epoll-ctl-add+ (engine-stop-fd engine)
             +epollin+ +stop-data+)
  ;; Edge-triggered: each signal wakes the housekeeper once, none is read.
  (setf (wheel-wake-fd (engine-wheel engine)) (make-eventfd))
  (epoll-ctl (engine-housekeeper-epfd engine) +epoll-ctl-add+
             (wheel-wake-fd (engine-wheel engine))
             (logior +epollin+ +epollet+) +keeper-wake-data+)
  (when listen-fd
    (set-nonblocking listen-fd)
    ;; Inherited by every socket accepted from it: no system call per accept.
    (set-notsent-lowat listen-fd +kernel-unsent-bytes+)
    (epoll-ctl (engine-housekeeper-epfd engine) +epoll-ctl-add+ listen-fd
               +epollin+ +listen-data+))
  (let ((timers (make-timers)))
    (setf (pool-timers (engine-pool engine)) timers)
    (epoll-ctl (engine-housekeeper-epfd engine) +epoll-ctl-add+ (timers-fd timers)
               +epollin+ +timer-data+))
  (pool-start (engine-pool engine))
  (setf (engine-state engine) :running)
  (register-engine engine)
  (setf (engine-housekeeper engine)
        (start-pool-thread (engine-pool engine) (lambda () (housekeeper-loop engine))
                           (format nil "~A-housekeeper" (engine-name engine)) "keeper"))
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
  "How long a stop waits for the handlers it interrupted (CUT-REQUESTS)
before it shuts the sockets of those still running and interrupts them
again.")

(defun left-to-owner-p (c)
  "True when the handler on C detached its stream (CONNECTION-DETACH) and
may have given it to another thread: a stop shuts nothing and writes nothing
there, even before the handler returns (its interruption, if it still runs,
only unwinds it: INTERRUPT-HANDLER).  A stream that switched protocols under
its handler (CONNECTION-SWITCH) is not: the stop shuts it."
  (and (conn-slot c detaching) (not (conn-slot c switched))))

(defun cut-requests (engine)
  "A stop gives up waiting: make every handler still running signal
HANDLER-TIMEOUT (with no deadline: counted in :STOP-CUT, see
INTERRUPT-HANDLER).  Its own worker then answers 503 if no byte of an
answer went out yet (RUN-HANDLER), after the layer above logged the
request (STOP-CUT-MESSAGE), and closes the connection: the worker owns it,
so the 503 is written once and never beside the handler's own output.
Other connections a thread still holds between requests have their
sockets shut; not those a handler detached (LEFT-TO-OWNER-P)."
  (loop for c across (engine-table engine)
        when (and c (member (connection-state c) '(:active :dirty)))
          do (let ((thread (conn-slot c handler-thread))
                   (serial (conn-slot c handler-serial)))
               (cond (thread
                      (handler-case (interrupt-handler c thread serial nil)
                        (error (e) (log-engine-error engine "Interrupting ~A: ~A" thread e))))
                     ((not (left-to-owner-p c))
                      (shutdown-fd (connection-fd c) +shut-rdwr+))))))

(defun interrupt-running-handlers (engine)
  "Signal HANDLER-TIMEOUT again in every worker still running a handler a
while after CUT-REQUESTS interrupted it (it caught the condition and ran on,
or ran without interrupts all that time)."
  (loop for c across (engine-table engine)
        when c
          do (let ((thread (conn-slot c handler-thread))
                   (serial (conn-slot c handler-serial)))
               (when (and thread (member (connection-state c) '(:active :dirty)))
                 (log-engine-error engine "Stopping: the handler of ~A still runs a second ~
                                           after its interruption: interrupting it again" c)
                 (ignore-errors (interrupt-handler c thread serial nil))))))

(defun stop-pending-count (engine)
  "ENGINE's connections a soft stop waits for: those parked (idle, or with
an answer to send or a request coming), served, or lingering after a last
answer; not those a handler detached, nor the silent ones only the
housekeeper watches."
  (loop for c across (engine-table engine)
        count (and c (member (connection-state c) '(:parked :active :dirty :draining)))))

(defun end-housekeeper (engine)
  "Let ENGINE's housekeeper go (it stopped accepting at the stop's start),
and join it."
  (setf (engine-housekeeper-exit engine) t)
  (signal-eventfd (wheel-wake-fd (engine-wheel engine)))
  (when (engine-housekeeper engine)
    (sb-thread:join-thread (engine-housekeeper engine) :default nil)
    (setf (engine-housekeeper engine) nil)))

(defun engine-drain (engine)
  "Mark ENGINE as draining: ENGINE-READY-P is false from now on while it
still serves as before, so that a readiness check tells a load balancer to
stop sending before a soft stop begins."
  (setf (engine-draining engine) t)
  engine)

(defun engine-ready-p (engine)
  "True while ENGINE runs and is not draining (ENGINE-DRAIN, or a stop)."
  (and (engine-running-p engine) (not (engine-draining engine))))

(defun engine-stop (engine &key soft)
  "Stop ENGINE: stop accepting, close idle connections, cut the requests in
flight (CUT-REQUESTS: each handler still running is interrupted with
HANDLER-TIMEOUT, its client gets 503 if no answer began, its request is
logged and counted in :STOP-CUT; a handler still running a second later has
its socket shut and is interrupted again), and join every thread.  A SOFT
stop first accepts what waits on a listen socket of its own (FINAL-ACCEPT),
keeps idle keep-alive connections for STOP-IDLE-GRACE, answers every request
that arrives meanwhile with Connection: close, and waits for requests in
flight and for answers their clients are still reading: all within
STOP-TIMEOUT, after which it cuts the rest as a hard stop does (so a stop
can take that, the hard stop's second, and the workers' exits).
Connections a handler detached are left to it.  The listen socket itself
belongs to the caller, who closes it afterwards."
  ;; The state first: a thread that finds the engine draining finds its
  ;; answers saying Connection: close.  One caller stops it; another (a
  ;; SIGTERM's beside the application's own) waits until it is stopped, so
  ;; that neither goes on to close what the stop still uses.
  (unless (eq :running (sb-ext:compare-and-swap (engine-state engine) :running :stopping))
    (loop while (eq (engine-state engine) :stopping)
          do (sleep 0.01))
    (return-from engine-stop engine))
  (setf (engine-draining engine) t
        (engine-final-accept engine) (and soft (engine-own-listener engine))
        (engine-housekeeper-exit engine) (not soft))
  (signal-eventfd (engine-stop-fd engine))
  ;; Connections that switched protocols under their handler (a
  ;; WebSocket read in its handler's own loop) never end by themselves:
  ;; their clients see them closed, their handlers end.
  (loop for c across (engine-table engine)
        when (and c (member (connection-state c) '(:active :dirty))
                  (connection-switched-p c))
          do (shutdown-fd (connection-fd c) +shut-rdwr+))
  (let* ((start (now-ms))
         (deadline (+ start (if soft (engine-stop-timeout-ms engine) 0)))
         (idle-end (min deadline (+ start (engine-stop-idle-grace-ms engine))))
         (housekeeper (engine-housekeeper engine)))
    (when soft
      ;; What the housekeeper's last accept takes is served too.
      (loop until (or (engine-accepting-ended engine)
                      (null housekeeper)
                      (not (sb-thread:thread-alive-p housekeeper)))
            do (sleep 0.001))
      ;; A keep-alive client may be sending its next request right now:
      ;; closing its connection would cut that request off.  Keep the
      ;; idle ones until IDLE-END; each request served meanwhile is
      ;; answered with Connection: close, and its client goes elsewhere.
      ;; Then close the idle ones, but serve those whose clients had
      ;; already sent more, until nothing is left or the deadline.
      (loop
        (let ((now (now-ms)))
          (when (>= now deadline) (return))
          (when (>= now idle-end)
            (close-idle-connections engine :keep-readable t :parked-only t))
          (when (and (zerop (stop-pending-count engine))
                     (zerop (engine-in-flight engine)))
            (return))
          (sleep 0.005))))
    (end-housekeeper engine)
    (close-idle-connections engine)
    (unless (and soft (wait-for-in-flight engine (max 0 (- deadline (now-ms)))))
      (cut-requests engine)
      ;; A handler that caught the interrupt and runs on, or was in a
      ;; stretch without interrupts: cut its socket, then interrupt it again.
      (unless (wait-for-in-flight engine +hard-stop-grace-ms+)
        (loop for c across (engine-table engine)
              when (and c (member (connection-state c) '(:active :dirty))
                        (not (left-to-owner-p c)))
                do (shutdown-fd (connection-fd c) +shut-rdwr+))
        (interrupt-running-handlers engine))))
  (pool-stop (engine-pool engine))
  ;; Timers still pending are dropped: their server is gone.
  (let ((timers (shiftf (pool-timers (engine-pool engine)) nil)))
    (when timers (free-timers timers)))
  ;; Workers that finished after the first pass parked their connections
  ;; (an answer that promised keep-alive keeps its connection): close them.
  (close-idle-connections engine)
  (close-fd (engine-housekeeper-epfd engine))
  (close-fd (engine-stop-fd engine))
  ;; After POOL-STOP: no worker is left to push a deadline and wake the
  ;; housekeeper through it (which, gone, left the wheel not resting).
  (close-fd (shiftf (wheel-wake-fd (engine-wheel engine)) -1))
  (setf (engine-housekeeper-epfd engine) -1
        (engine-stop-fd engine) -1
        (engine-listen-fd engine) -1
        (engine-state engine) :stopped)
  (unregister-engine engine)
  engine)

;;; Stats

(defun engine-stats (engine)
  "A property list describing ENGINE now: :OPEN connections, :IDLE (parked in
epoll), :ACTIVE (owned by a worker or by a handler that detached them),
:IN-FLIGHT requests, :PENDING (whole request heads waiting for a worker,
see ENGINE-OVERLOADED-P), totals :ACCEPTED,
:CLOSED, :REQUESTS, :SHED (503: queue full, or head budget spent),
:HEAD-BYTES (input buffers counted against the head budget: those of
connections parked with a partial head, and those grown for a long head),
:REJECTED (400/408/414/431), :WRITING (connections parked in epoll until
the client reads their unsent output: counted in :IDLE too), :UNSENT-BYTES
(their output, in all), :TIMEOUTS, :WRITE-TIMEOUTS (connections closed because
the client read nothing for the write timeout; counted in :TIMEOUTS too), :ABORTED (requests the client gave up on: it closed or reset the
connection while a handler read or answered), :SUSPENDED (requests an app
answers later from another thread, waiting for it: counted in :IN-FLIGHT
too), :ABANDONED (such requests whose client went away before the answer:
freed at once), :UPGRADED and :UPGRADES (connections that switched
protocols, a WebSocket, see upgrade.lisp: open now, and in all),
:SWITCHED (connections that switched protocols under a handler that keeps
its thread, hunchensocket's WebSockets, see CONNECTION-SWITCH: open now),
:STOP-CUT (requests whose handler still ran when a stop gave up waiting, and
was interrupted: see ENGINE-STOP), :BODY-BYTES and :DISK-BYTES (request bodies the engine is
reading or holds for their handlers, in memory and in temporary files, see
spool.lisp), :BODY-FILES (bodies that went to a temporary file, in all),
:SLOW-CLIENTS (connections ended for sending or reading under the minimum
data rate; counted in :TIMEOUTS too), :WAITING-WRITERS (writers waiting
for their clients now because the memory account refused what they write,
at most MAX-WAITING-WRITERS, see WAIT-FOR-ROOM), :WRITERS-SHED (connections
closed instead, because that many waited already, in all), :TIMERS (application timers pending,
see timers.lisp); the process-wide memory account (account.lisp):
:MEMORY-BYTES (octets held for clients, by all the servers of the process),
:MEMORY-LIMIT (that of the heap's kinds, all but :STACKS), :STACKS-LIMIT,
:MEMORY (a property list of them by kind: :HEADS, :BODIES,
:MESSAGES, :INFLATE, :OUTPUT, :STACKS), :OVERLOAD-LEVEL (0 to 3, see
overload.lisp), :OVERLOAD-PAUSED, :OVERLOAD-REFUSED and :OVERLOAD-SHED (the
overload manager's actions, in all); and
the pool's :THREADS,
:IDLE-THREADS, :RUN-PERMITS (how many workers may serve at once), :EPOLL-SETS
\(its groups of workers, see *GROUP-COUNT*) and :MOVED (events a group's workers
served for another group whose workers were all busy), see pool/groups.lisp."
  (let ((open 0) (idle 0) (active 0) (writing 0) (unsent 0)
        (table (engine-table engine)))
    (loop for c across table
          when c
            do (incf open)
               (case (connection-state c)
                 (:waiting (incf idle))
                 (:parked (incf idle)
                  (let ((n (connection-unsent-bytes c)))
                    (when (plusp n) (incf writing) (incf unsent n))))
                 ((:active :dirty :detached) (incf active))))
    (multiple-value-bind (paused refused shed) (overload-counts)
      (let ((pool (engine-pool engine)))
        (list :open open :idle idle :active active
              :in-flight (engine-in-flight engine)
              :pending (engine-pending engine)
              :head-bytes (engine-head-bytes engine)
              :body-bytes (engine-body-bytes engine)
              :disk-bytes (engine-disk-bytes engine)
              :body-files (engine-body-files engine)
              :slow-clients (engine-slow-clients engine)
              :waiting-writers (engine-waiting-writers engine)
              :writers-shed (engine-writers-shed engine)
              :accepted (engine-accepted engine)
              :closed (engine-closed engine)
              :requests (engine-requests engine)
              :shed (engine-shed engine)
              :rejected (engine-rejected engine)
              :writing writing
              :unsent-bytes unsent
              :timeouts (engine-timeouts engine)
              :write-timeouts (engine-write-timeouts engine)
              :aborted (engine-aborted engine)
              :suspended (engine-suspended engine)
              :abandoned (engine-abandoned engine)
              :upgraded (engine-upgraded engine)
              :upgrades (engine-upgrades engine)
              :switched (engine-switched engine)
              :stop-cut (engine-stop-cut engine)
              :timers (timers-pending-count (and pool (pool-timers pool)))
              :threads (if pool (pool-thread-count pool) 0)
              :idle-threads (if pool (pool-idle-count pool) 0)
              :run-permits (if pool (pool-run-permits pool) 0)
              :epoll-sets (if pool (length (pool-groups pool)) 0)
              :moved (if pool (pool-moved pool) 0)
              :stolen (if pool (pool-stolen pool) 0)
              :memory-bytes (account-used)
              :memory-limit (account-limit)
              :stacks-limit (account-limit :stacks)
              :memory (loop for kind across +account-kinds+
                            collect kind collect (account-used kind))
              :overload-level (overload-level)
              :overload-paused paused
              :overload-refused refused
              :overload-shed shed)))))
