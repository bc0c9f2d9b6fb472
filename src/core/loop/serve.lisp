;;;; serve.lisp -- a worker serving a connection: the event, the request
;;;; heads read until complete, a body read before its handler (GATHER-BODY),
;;;; the handler run (handler.lisp), then park, close, or leave the
;;;; connection (detached) as the handler's use of the stream decided.  An
;;;; answer the socket did not take whole parks the connection for EPOLLOUT
;;;; first; the worker that takes that event sends the rest, then goes on
;;;; (AFTER-WRITE: the next request, or the close).  A further pipelined
;;;; request waits its turn (YIELD-TURN).  A request answered later from
;;;; another thread changes hands (CONNECTION-SUSPEND ... CONNECTION-RESUME).

(in-package #:gallop.core)

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


(defun serve-connection (engine c)
  "Read until a request head is complete, check it, run the handler; then
park, close or leave C as the handler decided.  A further request already
buffered (pipelining) waits its turn behind other ready connections
(YIELD-TURN), and none is read while an answer is unsent.  The caller owns C."
  (unfresh c)
  (setf (conn-slot c waiting-turn) nil)
  (when (conn-slot c upgrade)
    (return-from serve-connection (serve-upgraded c)))
  (when (or (conn-slot c unsent) (conn-slot c suspended))
    ;; Back from waiting for the client to read the last answer.
    (when (output-parked-p c)
      (return-from serve-connection))
    (when (conn-slot c suspended)
      ;; A request answered later from another thread: C waits in epoll
      ;; between its writes, and an event says the client sent more or went
      ;; away.  Gone: C is freed now, not when the answer comes.
      (unless (abandon-if-gone c)
        (park-suspended c))
      (return-from serve-connection))
    (when (eq (shiftf (conn-slot c after-write) nil) :close)
      (return-from serve-connection (close-after-answer c))))
  ;; C keeps its share of the head budget while this worker reads into its
  ;; buffer: buffers being read count as much as parked ones.
  (with-connection-slots (in-end raw) c
    (flet ((head-ready-p ()
             ;; A complete head is buffered; a head over a limit is refused
             ;; at once, complete or not.
             (ecase (scan-head c)
               (:complete t)
               (:incomplete nil)
               (:line-too-long (return-from serve-connection (reject c +response-414+)))
               (:too-large (return-from serve-connection (reject c +response-431+))))))
      (loop
        (let ((ready (cond (raw (< (conn-slot c in-start) in-end))
                           ;; Back for more of a body (GATHER-BODY).
                           ((request-gathering (connection-request c)) :body)
                           (t (head-ready-p)))))
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
              (multiple-value-bind (n errno) (connection-recv c buffer in-end (length buffer))
                (setf (conn-slot c drained) (< n (- (length buffer) in-end)))
                (cond ((plusp n)
                       (incf in-end n)
                       (setf ready (or raw (head-ready-p))))
                      ((zerop n)
                       ;; End of file inside a head: a request line already
                       ;; whole and refused is answered whether or not a read
                       ;; saw it before the end; any other cut head ends
                       ;; quietly.
                       (let ((refusal (and (not raw) (check-partial-head c))))
                         (return (if refusal
                                     (reject c (error-response refusal))
                                     (close-connection c)))))
                      ((= errno +eagain+)
                       (let ((refusal (and (not raw) (check-partial-head c))))
                         (when refusal
                           (return (reject c (error-response refusal)))))
                       (when (park c) (return)))
                      (t (return (close-connection c)))))))
          (when ready
            (unless (or raw (eq ready :body))
              (let ((refusal (check-head c)))
                (when refusal
                  (return (reject c (error-response refusal)))))
              (begin-message c)
              (when (gather-body-p c)
                (when (refuses-body-p c)
                  ;; Short of memory (overload.lisp, level 2).
                  (sb-ext:atomic-incf (engine-shed engine))
                  (return (reject-connection c (response-503 engine))))
                (begin-gathering c)))
            (when (and (request-gathering (connection-request c)) (not (gather-body c)))
              (return))
            (ecase (run-handler engine c)
              (:park
               (when (conn-slot c upgrade)
                 ;; It switched protocols (upgrade.lisp).
                 (return (serve-upgraded c)))
               ;; The answer promised keep-alive, so C is kept even if the
               ;; engine began stopping meanwhile: a close now would meet
               ;; the client's next request.  A soft stop answers that one
               ;; with Connection: close; any stop closes C if idle.
               (unless (and (not (request-close-after (connection-request c))) (finish-message c))
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
               (when (and (not raw) (park-if-quiet c))
                 (return)))
              (:close (return (close-after-answer c)))
              (:detached (return))
              (:suspended
               ;; Let go of C: it waits in epoll, holding no empty buffer
               ;; (PARK-SUSPENDED), until its answering thread takes it
               ;; (CONNECTION-ACQUIRE).
               (return (connection-release c))))))))))

(defun gather-body (c)
  "Read C's request body, as far as it has arrived, into its spool, without
waiting.  True once all of it is here: BODY-MODE is :SPOOL, and the handler
may run.  NIL when C was parked to wait for more (its deadline set by PARK),
or rejected (400 or 413 for the body, 503 when it cannot be held) or closed
\(the client went away): the caller lets go of C."
  (let ((engine (connection-engine c)))
    (with-connection-slots (inbuf in-start in-end) c
      (with-request-slots (head-left body-mode body-left spool gathering rate-start rate-octets
                           progress)
          (connection-request c)
        (handler-case
            (loop
              (let ((base (+ in-start head-left)))
                (declare (type fixnum base))
                (when (< base in-end)
                  (let ((used (spool-input c base in-end)))
                    (unless used
                      (sb-ext:atomic-incf (engine-shed engine))
                      (reject-connection c (response-503 engine))
                      (return nil))
                    ;; What follows the body (a next request) stays after the head.
                    (replace inbuf inbuf :start1 base :start2 used :end2 in-end)
                    (setf in-end (+ base (- in-end used)))))
                (when (body-gathered-p c)
                  (setf gathering nil
                        rate-start 0
                        body-mode :spool
                        body-left (spool-fill spool))
                  (return t))
                (unless (room-after-head c)
                  (sb-ext:atomic-incf (engine-shed engine))
                  (reject-connection c (response-503 engine))
                  (return nil))
                (let ((buffer inbuf))
                  (multiple-value-bind (n errno) (connection-recv c buffer in-end (length buffer))
                    (declare (type fixnum n))
                    (setf (conn-slot c drained) (< n (- (length buffer) in-end)))
                    (cond ((plusp n)
                           (incf in-end n)
                           (incf rate-octets n)
                           (setf progress (now-ms)))
                          ((zerop n)
                           ;; The client ended its side in the middle of its
                           ;; request: there is nothing to answer.
                           (close-connection c)
                           (return nil))
                          ((= errno +eagain+)
                           (when (park c)
                             (return nil)))
                          (t (close-connection c)
                             (return nil)))))))
          (request-body-error (e)
            (reject c (error-response (request-body-error-status e)))
            nil)
          (connection-error ()
            (close-connection c)
            nil))))))

(defun park-if-quiet (c)
  "After an answer, with nothing buffered: park C without trying another read,
and return true.  Most clients send their next request only after this
answer, so that read would nearly always fail with EAGAIN; input that came
meanwhile raised an event that left C :DIRTY, and PARK then says to read
\(NIL).  Only when the last read left input behind (a full buffer), or the
client half-closed (its end of file raised no event of its own), is the read
needed (NIL, C not parked)."
  (and (= (conn-slot c in-start) (conn-slot c in-end))
       (conn-slot c drained) (not (conn-slot c peer-closed))
       (park c)))

(defun yield-turn (c)
  "C has served a request and has the next one buffered (pipelining): let it
wait its turn behind the other ready connections, as nginx does, instead of
serving a client's pipelined requests for as long as it sends them while
new clients wait.  C is parked with its input and queued for a worker (see
GROUP-REQUEUE).  True when C was given up, NIL when an event marked it :DIRTY
meanwhile: the caller still owns C and goes on serving it."
  (setf (conn-slot c waiting-turn) t)
  (cond ((park c)
         (group-requeue (connection-group c) (connection-token c))
         t)
        (t (setf (conn-slot c waiting-turn) nil)
           nil)))

(defun output-parked-p (c)
  "C has unsent output (output-queue.lisp): send what the socket takes
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
before the client read it).  A TLS connection always lingers, after its
close_notify (REJECT-CONNECTION): a TLS client sends its own close_notify
alert, data, as soon as it is done, often before the answer came (and on a
raw connection what the client sent is not known here at all)."
  (when (conn-slot c unsent)
    (setf (conn-slot c after-write) :close)
    (when (output-parked-p c)
      (return-from close-after-answer)))
  (if (and (not (conn-slot c raw)) (zerop (conn-slot c tls))
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
    (sb-ext:atomic-incf (engine-suspended (connection-engine c)))
    (begin-in-flight c)))

(defun connection-unsuspend (c)
  "Undo CONNECTION-SUSPEND before the handler returned (the answer came first)."
  (setf (conn-slot c suspended) nil
        (conn-slot c out-parked) nil)
  (sb-ext:atomic-decf (engine-suspended (connection-engine c)))
  (end-in-flight c))

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
wrote (and by the worker when the handler returned): C goes back to epoll,
where the engine sends what the client did not read yet (OUTPUT-PARKED-P)
and sees a client that goes away (ABANDON-IF-GONE); the answering thread
takes C back at its next CONNECTION-ACQUIRE."
  (setf (conn-slot c out-parked) t)
  (unless (output-parked-p c)
    (park-suspended c))
  nil)

(defun park-suspended (c)
  "Park C, whose request waits for its answer from another thread (the
caller owns C, :ACTIVE), with its empty buffers given back and no deadline;
an event came meanwhile: look at it first (ABANDON-IF-GONE)."
  (loop
    (release-buffers c)
    (schedule c (+ (now-ms) +suspended-check-ms+))
    (case (sb-ext:compare-and-swap (%conn-slot c state) :active :parked)
      (:active (return))
      (:dirty (setf (connection-state c) :active)
       (when (abandon-if-gone c)
         (return)))
      (t (error "PARK-SUSPENDED: ~A is not owned by this thread" c)))))

(defun abandon-if-gone (c)
  "C's request is suspended, and an event came: read what the client sent.
True (C is closed, the request ABANDONED) when the connection failed: the
client reset it, or it broke.  A client that only ended its side (FIN) may
still read its answer (HTTP allows a half-close after the request, and
every front end answers one, see the conformance corpus): its request
waits on, and its answer finds out whether it is gone.  What a client sends
meanwhile (its next request) stays buffered for after the answer."
  (with-connection-slots (in-end drained) c
    (loop
      (let ((buffer (ensure-inbuf c)))
        (when (>= in-end (length buffer))
          ;; Kept for after the answer; the rest is still in the socket,
          ;; which raises no new event for it: read before parking then.
          (setf drained nil)
          (return nil))
        (multiple-value-bind (n errno) (connection-recv c buffer in-end (length buffer))
          (cond ((plusp n) (incf in-end n))
                ((zerop n)
                 ;; The end of its input: no event will say more.
                 (setf (conn-slot c peer-closed) t)
                 (return nil))
                ((= errno +eagain+) (setf drained t) (return nil))
                (t (abandon c) (return t))))))))

(defun abandon (c)
  "The client of C's suspended request went away: close C now and end the
request; its answer, when it comes, finds C closed (CONNECTION-ACQUIRE)."
  (let ((engine (connection-engine c)))
    (setf (conn-slot c abandoned) t)
    (sb-ext:atomic-incf (engine-abandoned engine))
    (sb-ext:atomic-decf (engine-suspended engine))
    (end-in-flight c)
    (close-connection c)))

(defun connection-resume (c keep-alive)
  "Finish a suspended request from the thread that answered it, which owns C
\(CONNECTION-ACQUIRE): when KEEP-ALIVE, give C back to the engine (a worker
serves its next request, never this thread, which may be an application's
timer or broadcaster), else close it (after the client read the answer)."
  (let ((engine (connection-engine c)))
    (when (conn-slot c abandoned)
      ;; Ended when the client went away (ABANDON).
      (return-from connection-resume))
    (sb-ext:atomic-decf (engine-suspended engine))
    (end-in-flight c)
    (when (member (connection-state c) '(:closed :draining :detached))
      (return-from connection-resume))
    (setf (conn-slot c suspended) nil
          (conn-slot c out-parked) nil)
    (if (and keep-alive (engine-running-p engine)
             (not (request-close-after (connection-request c)))
             (finish-message c))
        (handler-case (if (conn-slot c unsent)
                          ;; Parks C until the client read it (or sends it).
                          (serve-connection engine c)
                          ;; A worker serves what comes next: C waits in
                          ;; epoll, or when input may be there already, in
                          ;; the pool's queue (as in SERVE-CONNECTION).
                          (unless (park-if-quiet c)
                            (loop until (yield-turn c))))
          (serious-condition (e)
            (log-engine-error engine "Error resuming ~A: ~A" c e)
            (unless (member (connection-state c) '(:closed :detached :draining))
              (close-connection c))))
        (close-after-answer c))))
