;;;; housekeeper.lisp -- the engine's own thread: it accepts (accept.lisp),
;;;; drains rejected connections before closing them (so a client reads its
;;;; error answer instead of a reset), and every tick closes parked
;;;; connections whose deadline passed (408 when part of a head had arrived,
;;;; a write timeout when the client read nothing of its answer).  When an
;;;; application timer comes due (timers.lisp) it hands its thunk to the pool.
;;;; A tick is every +TICK-MS+, or every +REST-TICK-MS+ while no connection
;;;; is open (the wheel rests, wheel.lisp).

(in-package #:gallop.core)

(defun connection-event (engine token)
  "An event in the housekeeper's set for the connection of TOKEN: one being
drained (DRAIN), or a silent one that sent its first octets (WAKE-SILENT)."
  (let* ((fd (logand token #xffffffff))
         (table (engine-table engine))
         (c (and (< fd (length table)) (svref table fd))))
    (when (and c (= (connection-token c) token))
      (case (connection-state c)
        (:draining (drain c))
        (:waiting (wake-silent c))))))

(defun drain (c)
  "Read and discard what the client of the rejected connection C sends;
close C at its end of file."
  (let ((fd (connection-fd c))
        (scratch (ensure-inbuf c)))
    (loop
      (multiple-value-bind (n errno) (read-into fd scratch 0 (length scratch))
        (cond ((plusp n))
              ((and (minusp n) (= errno +eagain+)) (return))
              (t (close-connection c) (return)))))
    (when (conn-slot c inbuf) (release-buffers c))))

(defun expire (engine c now)
  "The wheel brought C up at NOW: close it if its deadline passed (with 408
when part of a request head had arrived), else schedule it again."
  (flet ((due-p () (<= (connection-deadline c) now)))
    (case (connection-state c)
      (:parked
       (cond ((not (due-p))
              (wheel-schedule (engine-wheel engine) c (connection-deadline c) :from-advance t))
             ((and (conn-slot c unsent) (client-read-a-period-p c))
              ;; The client reads, if more slowly than its socket says
              ;; writable: another period (its owner, should an event take
              ;; it meanwhile, only makes its deadline later).
              (let ((deadline (output-deadline c)))
                (setf (connection-deadline c) deadline)
                (wheel-schedule (engine-wheel engine) c deadline :from-advance t)))
             ((and (null (conn-slot c unsent))
                   (or (conn-slot c suspended)
                       (let ((u (conn-slot c upgrade)))
                         (and u (zerop (upgrade-idle-ms u))))))
              ;; Waiting for its answer from another thread, or switched
              ;; protocols with no idle timeout: no deadline.
              (wheel-schedule (engine-wheel engine) c (+ now +suspended-check-ms+) :from-advance t))
             ((eq (sb-ext:compare-and-swap (%conn-slot c state) :parked :active) :parked)
              (cond ((conn-slot c unsent)
                     ;; The client read nothing of its answer for the write
                     ;; timeout, or too little under the minimum rate (a
                     ;; slow-read attack, or a dead peer).
                     (unless (conn-slot c timed-out) ; counted when a write timed out
                       (sb-ext:atomic-incf (engine-timeouts engine))
                       (sb-ext:atomic-incf (engine-write-timeouts engine))
                       (multiple-value-call #'note-if-slow engine (output-deadlines c)))
                     (set-reset-on-close (connection-fd c))
                     (close-connection c))
                    ((request-gathering (connection-request c))
                     ;; Its body came too slowly (GATHER-BODY).
                     (sb-ext:atomic-incf (engine-timeouts engine))
                     (multiple-value-call #'note-if-slow engine (body-deadlines c))
                     (reject c +response-408+))
                    ((conn-slot c head-started)
                     (sb-ext:atomic-incf (engine-timeouts engine))
                     (multiple-value-call #'note-if-slow engine (head-deadlines c))
                     (reject c +response-408+))
                    ((conn-slot c fresh)
                     ;; Connected but never sent a byte in time.
                     (sb-ext:atomic-incf (engine-timeouts engine))
                     (close-connection c))
                    (t (close-connection c))))))
      (:waiting
       ;; Connected, sent nothing while no worker was free, and still
       ;; nothing in time.
       (cond ((not (due-p))
              (wheel-schedule (engine-wheel engine) c (connection-deadline c) :from-advance t))
             (t (sb-ext:atomic-incf (engine-timeouts engine))
                (close-connection c))))
      (:draining
       (if (due-p)
           (close-connection c)
           (wheel-schedule (engine-wheel engine) c (connection-deadline c) :from-advance t)))
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
                             (max (connection-deadline c) (+ now +tick-ms+))
                             :from-advance t)))))))

(defun note-if-slow (engine timeout rate)
  "A connection expired: count it in :SLOW-CLIENTS when the minimum data
rate (its deadline RATE, or NIL) came before its TIMEOUT."
  (when (and rate (< rate timeout))
    (sb-ext:atomic-incf (engine-slow-clients engine))))

(defconstant +trim-after-tls-frees+ 512
  "SSL objects freed since the last trim that make a trim due (TRIM-MALLOC).")

(defconstant +trim-interval-ms+ 1000
  "The least time between two trims.")

(defun trim-malloc (engine now)
  "Once many TLS connections were freed (+TRIM-AFTER-TLS-FREES+), at most
once a second: give the C heap's free pages back to the system
\(malloc_trim).  OpenSSL keeps each connection's state in malloc's heap,
about 15 KiB; glibc keeps what is freed for reuse, spread over its arenas,
so that 10,000 idle TLS connections, once closed, left their 140 MiB in
the process for good (doc/design.md, \"Closed TLS connections give their
memory back\")."
  (let ((freed (engine-tls-freed engine)))
    (when (and (>= (- freed (engine-tls-trimmed engine)) +trim-after-tls-frees+)
               (>= (- now (engine-trim-ms engine)) +trim-interval-ms+))
      (setf (engine-tls-trimmed engine) freed
            (engine-trim-ms engine) now)
      (%malloc-trim 0))))

(defun close-idle-connections (engine &key keep-readable parked-only)
  "Close every parked and draining connection; with KEEP-READABLE, leave the
parked ones whose client already sent more (in the socket, or buffered
and waiting its turn) or is sending a request, for a worker to serve, and
those whose client is still reading an answer.  Returns how many parked
connections were left.  Used by ENGINE-STOP: with PARKED-ONLY while the
housekeeper runs (the waiting and draining connections are its own), and
without once it has exited."
  (let ((left 0))
    (loop for c across (engine-table engine)
          when c
            do (case (connection-state c)
                 (:parked
                  (if (and keep-readable
                           (or (conn-slot c unsent) ; an answer the client is still reading
                               (conn-slot c suspended) ; a request still to be answered
                               (conn-slot c waiting-turn) ; a request it sent, not served yet
                               ;; a request whose body is arriving
                               (request-gathering (connection-request c))
                               (conn-slot c head-started) ; a request whose head is arriving
                               (eq :ready (poll-fds (connection-fd c) +pollin+ -1 0))))
                      (incf left)
                      (when (eq (sb-ext:compare-and-swap (%conn-slot c state) :parked :active)
                                :parked)
                        (close-connection c))))
                 (:waiting
                  (cond (parked-only)
                        ((and keep-readable
                              (eq :ready (poll-fds (connection-fd c) +pollin+ -1 0)))
                         (wake-silent c)
                         (incf left))
                        (t (close-connection c))))
                 (:draining
                  (unless parked-only
                    (close-connection c)))))
    left))

(defconstant +rest-tick-ms+ 1000
  "The housekeeper's tick while its wheel holds no connection (resting, see
wheel.lisp): then nothing can come due before something wakes it (a new
connection, an application timer, a deadline pushed by another thread), and
it only keeps the wheel's clock near the time, so an idle server does not
wake every +TICK-MS+ for nothing (doc/design.md, \"A pool at rest\").")

(defun end-accepting (engine epfd accept-paused)
  "A stop began (STOP-FD readable): accepting ends here, after a final accept
of the engine's own socket in a soft stop; the rest goes on until
HOUSEKEEPER-EXIT.  STOP-FD stays readable for others: it leaves this set, as
the listening socket does (unless ACCEPT-PAUSED: then not in the set).
Returns ACCEPT-PAUSED as it is now."
  (epoll-ctl epfd +epoll-ctl-del+ (engine-stop-fd engine) 0 0)
  (unless (engine-accepting-ended engine)
    (when (>= (engine-listen-fd engine) 0)
      (unless accept-paused
        (epoll-ctl epfd +epoll-ctl-del+ (engine-listen-fd engine) 0 0))
      (setf accept-paused nil)
      (when (engine-final-accept engine)
        (handler-case (final-accept engine)
          (error (e) (log-engine-error engine "Final accept: ~A" e)))))
    (setf (engine-accepting-ended engine) t))
  accept-paused)

(defun hand-timers-to-pool (engine)
  "The application timers' timerfd fired: hand the thunk of each timer due to
ENGINE's pool (TIMERS-FIRE, POOL-SUBMIT): the housekeeper runs none itself."
  (handler-case
      (timers-fire (pool-timers (engine-pool engine))
                   (let ((pool (engine-pool engine)))
                     (lambda (thunk) (pool-submit pool thunk))))
    (error (e) (log-engine-error engine "Timer error: ~A" e))))

(declaim (inline housekeeper-event))
(defun housekeeper-event (engine epfd data accept-paused)
  "Phase 2: serve one event of the housekeeper's set, whose epoll data is
DATA: a stop (END-ACCEPTING), a wake-up that ended the wheel's rest
\(nothing to do: the tick follows), due timers (HAND-TIMERS-TO-POOL), new
connections (ACCEPT-PENDING, which pauses accepting when the engine may not
take more), or a connection of this set (CONNECTION-EVENT).  Returns
ACCEPT-PAUSED as it is now: true while the listening socket is out of the
set.  Inline: DATA, an unsigned 64-bit word, is never boxed."
  (cond ((= data +stop-data+) (end-accepting engine epfd accept-paused))
        ((= data +keeper-wake-data+) accept-paused) ; WHEEL-SCHEDULE ended the rest
        ((= data +timer-data+) (hand-timers-to-pool engine) accept-paused)
        ((= data +listen-data+)
         (if (and (not (engine-accepting-ended engine))
                  (eq (accept-pending engine) :paused))
             t
             accept-paused))
        (t (connection-event engine data) accept-paused)))

(defun housekeeper-tick (engine epfd wheel now accept-paused)
  "Phase 3, once a tick (+TICK-MS+) at NOW: the connection claims start afresh
\(a connection handed to a free worker a tick ago was taken, or is silent:
see FREE-WORKERS); the wheel brings up the connections whose deadline may
have passed (EXPIRE); the C heap is trimmed when due (TRIM-MALLOC); the
overload manager makes its pass (OVERLOAD-PASS); accepting, when paused,
resumes; and with no connection's deadline to look at, the wheel rests
\(once a second) until a push wakes this thread.  Each step's error is
logged, not raised: the thread outlives it.  Returns ACCEPT-PAUSED as it is
now."
  (setf (engine-claims engine) 0)
  (handler-case (wheel-advance wheel now (lambda (c) (expire engine c now)))
    (error (e) (log-engine-error engine "Timer error: ~A" e)))
  (handler-case (trim-malloc engine now)
    (error (e) (log-engine-error engine "malloc_trim: ~A" e)))
  (handler-case (overload-pass now)
    (error (e) (log-engine-error engine "Overload manager: ~A" e)))
  (when (and accept-paused (not (engine-accepting-ended engine)))
    (setf accept-paused nil)
    (epoll-ctl epfd +epoll-ctl-add+ (engine-listen-fd engine)
               +epollin+ +listen-data+))
  (unless (wheel-resting wheel)
    (wheel-rest wheel))
  accept-paused)

(defun housekeeper-loop (engine)
  "The life of ENGINE's housekeeper thread, from ENGINE-START until
HOUSEKEEPER-EXIT is set.  One turn, in order:
  1. Wait in its epoll set up to a tick: +TICK-MS+, or +REST-TICK-MS+ while
     the wheel rests.
  2. HOUSEKEEPER-EVENT for each event it got.
  3. HOUSEKEEPER-TICK, when a tick is due.
  4. Exit once HOUSEKEEPER-EXIT is set.
ACCEPT-PAUSED, carried from turn to turn, is true while the listening
socket is out of the set: ACCEPT-PENDING paused accepting, and the next tick
resumes it."
  (let ((events (make-event-buffer 64))
        (epfd (engine-housekeeper-epfd engine))
        (wheel (engine-wheel engine))
        (next-tick 0)
        (accept-paused nil))
    (unwind-protect
         (loop
           (let ((n (epoll-wait epfd events 64
                                (if (wheel-resting wheel) +rest-tick-ms+ +tick-ms+))))
             (dotimes (i n)
               (setf accept-paused
                     (housekeeper-event engine epfd (event-data events i) accept-paused)))
             (let ((now (now-ms)))
               (when (>= now next-tick)
                 (setf next-tick (+ now +tick-ms+)
                       accept-paused (housekeeper-tick engine epfd wheel now accept-paused))))
             (when (engine-housekeeper-exit engine)
               (return-from housekeeper-loop))))
      ;; No wake-ups once this thread is gone (ENGINE-STOP closes WAKE-FD).
      (setf (wheel-resting wheel) nil)
      (free-event-buffer events))))
