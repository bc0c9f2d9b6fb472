;;;; upgrade.lisp -- a connection that switched protocols (a WebSocket after
;;;; its 101): it waits in epoll between the client's messages as an idle
;;;; keep-alive connection does, holding no thread and no buffer.  What the
;;;; client sends goes to the layer above's read callback, on a pool worker;
;;;; what the layer above sends, from any thread, goes out without waiting for
;;;; the client.
;;;;
;;;; Who touches the socket.  One thread at a time owns the connection, as
;;;; for HTTP (connection.lisp, states): a worker that took its event, or a
;;;; sending thread that found it :PARKED and took it with the same CAS.
;;;; Another thread's send never waits for the owner: it pushes its octets on
;;;; the connection's MAILBOX and marks the connection :DIRTY, so that the
;;;; owner, whose PARK then fails, sends them before it lets go.  Only
;;;; workers run the read callback: a sender that owns the connection when
;;;; input is waiting hands it to the pool instead.  The octets waiting (the
;;;; mailbox and the output queue) are what a sender sees of backpressure,
;;;; and SEND-LIMIT bounds them: a send that finds more waiting closes the
;;;; connection, as the layer above says (ON-LIMIT: a WebSocket cuts what
;;;; its client has not begun to get and sends its close frame,
;;;; CONNECTION-CUT-UPGRADED) or at once.  What waits is counted in the
;;;; memory account as :OUTPUT; octets sent to many connections at once
;;;; (CONNECTION-SEND-SHARED) are counted there once, and in each
;;;; connection's backlog in full (output-queue.lisp, Shared octets).
;;;;
;;;; The UPGRADE record is kept beside the connection that holds it
;;;; (connection.lisp), and closing a connection ends it (NOTE-UPGRADE-ENDED,
;;;; lifecycle.lisp).  A handler that keeps its thread for the new protocol
;;;; switches instead (CONNECTION-SWITCH, at the end of this file).

(in-package #:gallop.core)

(defconstant +upgraded-turn-octets+ (* 64 1024)
  "Octets a worker reads from one upgraded connection before it lets others
have a turn (the connection goes behind them in the pool's queue).")

(defun connection-upgrade (c &key on-read on-close (idle-timeout nil idle-p)
                               (send-limit nil))
  "Called by a handler, in its worker, that answers 101 (Switching
Protocols), before it returns: once it returns, C is no longer HTTP.  ON-READ
is called on a pool worker as (ON-READ OCTETS START END) with what the
client sent, in order, one call at a time; the octets are the engine's
until it returns.  ON-CLOSE is called once, with no argument, when C ends
for any reason.  Octets the client sent after the request head go to ON-READ
first.  IDLE-TIMEOUT (seconds, NIL: none) closes C when the client sends
nothing for that long; the default is the engine's UPGRADED-IDLE-TIMEOUT.
SEND-LIMIT (octets) overrides the engine's UPGRADED-SEND-LIMIT.  Send with
CONNECTION-SEND-UPGRADED, close with CONNECTION-CLOSE-UPGRADED, from any
thread; both work already while the handler runs."
  (let ((engine (connection-engine c)))
    (when (or (conn-slot c raw) (conn-slot c source))
      (error "~A cannot switch protocols: TLS through a library above the engine." c))
    (when (let ((request (connection-request c)))
            (or (request-chunked request) (plusp (request-body-length request))))
      ;; Its octets after the head would be read as the new protocol's.
      (error "~A cannot switch protocols after a request with a body." c))
    (when (refuses-upgrades-p)
      ;; Short of memory (overload.lisp, level 2): the layer above answers 503.
      (error 'overloaded))
    (let ((u (make-upgrade on-read on-close
                           (if idle-p
                               (if idle-timeout (max 1 (round (* 1000 idle-timeout))) 0)
                               (engine-upgraded-idle-ms engine))
                           (or send-limit (engine-upgraded-send-limit engine)))))
      ;; Its sends push on the mailbox until the handler returned.
      (setf (upgrade-reader u) sb-thread:*current-thread*
            (conn-slot c upgrade) u)
      (connection-count-answer c 101)
      u)))

(defun connection-set-upgraded-on-shed (c function)
  "How the upgraded connection C is closed when the overload manager sheds
it (shed.lisp): FUNCTION, called with no argument from the manager's
thread, must not wait (a WebSocket sends its close frame and aborts).
Without one, C is closed at once."
  (setf (upgrade-on-shed (conn-slot c upgrade)) function))

(defun connection-set-upgraded-idle-timeout (c seconds)
  "Close the upgraded connection C when its client sends nothing for SECONDS
\(NIL: never)."
  (setf (upgrade-idle-ms (conn-slot c upgrade))
        (if seconds (max 1 (round (* 1000 seconds))) 0)))

(defun connection-charge-upgraded (c delta &optional (kind :messages))
  "Count DELTA octets (negative: fewer) that the layer above holds for the
upgraded connection C, a message it assembles (KIND :MESSAGES) or what
inflating one made (:INFLATE), against the engine's body budget, the one
request bodies share, and in the memory account (account.lisp): all the
clients together can hold no more than they allow, whatever they send.
NIL when that would exceed either (nothing is counted).  What is counted
when C ends is given back (NOTE-UPGRADE-ENDED)."
  (declare (type fixnum delta))
  (let ((u (conn-slot c upgrade))
        (engine (connection-engine c)))
    (cond ((minusp delta) (give-back-upgraded engine u kind (- delta)))
          ((upgrade-ended u) nil)
          ((not (charge-budget engine #'body-bytes-incf (engine-body-budget engine) delta))
           nil)
          ((not (account-charge kind delta))
           (body-bytes-incf engine (- delta))
           nil)
          (t
           (if (eq kind :inflate)
               (sb-ext:atomic-incf (upgrade-inflated u) delta)
               (sb-ext:atomic-incf (upgrade-charged u) delta))
           (when (upgrade-ended u)
             ;; Ended meanwhile: NOTE-UPGRADE-ENDED may have given back
             ;; before this was counted.
             (give-back-upgraded engine u kind delta))
           t))))

(declaim (inline connection-upgraded-p))
(defun connection-upgraded-p (c)
  "True once a handler called CONNECTION-UPGRADE on C."
  (and (conn-slot c upgrade) t))

(defun connection-upgraded-pending (c)
  "Octets sent on the upgraded connection C that the client has not taken
yet: the sender's measure of backpressure (any thread; approximate while
another thread sends)."
  (let ((u (conn-slot c upgrade)))
    (if u
        (+ (upgrade-mailbox-bytes u) (max 0 (conn-slot c unsent-bytes)))
        0)))

(defun connection-upgraded-idle-timeout (c)
  "Seconds the upgraded connection C may receive nothing before it is
closed, or NIL: no limit."
  (let ((ms (upgrade-idle-ms (conn-slot c upgrade))))
    (and (plusp ms) (/ ms 1000.0))))

(defun connection-upgraded-silence (c)
  "Seconds since the client of the upgraded connection C last sent
anything (0 until its handler returned), and a mark of that moment, the
same until the client sends again."
  (let* ((u (conn-slot c upgrade))
         (last (upgrade-last-input u)))
    (values (if (upgrade-entered u) (/ (max 0 (- (now-ms) last)) 1000.0) 0.0)
            last)))

;;; Sending and closing, from any thread

(defun kick-upgraded (c u)
  "Make sure what U's mailbox holds, or its closing, is acted on: by C's
owner when there is one (marked :DIRTY, it looks again before it lets go),
else by this thread, which takes C.  NIL when C is closed."
  (loop
    (case (connection-state c)
      (:parked
       (when (eq :parked (sb-ext:compare-and-swap (%conn-slot c state) :parked :active))
         (flush-upgraded-as-sender c u)
         (return t)))
      (:active
       (when (or (eq (upgrade-reader u) sb-thread:*current-thread*)
                 ;; The read callback sends: its worker drains the mailbox
                 ;; after the callback.
                 (eq :active (sb-ext:compare-and-swap (%conn-slot c state) :active :dirty)))
         (return t)))
      (:dirty (return t))
      (t (return nil)))))

(defconstant +short-of-memory-backlog+ (* 64 1024)
  "Short of memory (the overload manager's level 1 or more, overload.lisp),
a backlog past this is too much: a send to such a connection closes it as
its send limit would.  Its client has not read what waits, and the octets
it holds are what the manager must otherwise shed.")

(defun behind-p (c u)
  "True when more waits for the client of the upgraded C (U its record) than
may: past its send limit, or, short of memory, past
+SHORT-OF-MEMORY-BACKLOG+.  One message alone may be larger than either; a
backlog may not."
  (let ((pending (connection-upgraded-pending c)))
    (or (> pending (upgrade-send-limit u))
        (and (> pending +short-of-memory-backlog+) (>= (overload-level) 1)))))

(defun close-upgraded-as-layer-says (c function why)
  "Close the upgraded connection C by FUNCTION, the layer above's way (a
WebSocket's close frame first), or at once when there is none or it fails
\(logged, with WHY)."
  (if function
      (handler-case (funcall function)
        (error (e)
          (log-engine-error (connection-engine c) "Closing ~A ~A: ~A" c why e)
          (connection-close-upgraded c :abort t)))
      (connection-close-upgraded c :abort t)))

(defun fall-behind (c u)
  "C's client fell behind (BEHIND-P): count it among the slow clients and
close C as its layer says (ON-LIMIT), else at once."
  (sb-ext:atomic-incf (engine-slow-clients (connection-engine c)))
  (close-upgraded-as-layer-says c (upgrade-on-limit u) "past its send limit"))

(defun queue-upgraded (c u segment)
  "Push SEGMENT on U's mailbox, counted, and see that it goes out.  What
CONNECTION-SEND-UPGRADED answers."
  (let ((n (- (segment-end segment) (segment-start segment))))
    (sb-ext:atomic-incf (upgrade-mailbox-bytes u) n)
    (count-segment segment)
    (sb-ext:atomic-push segment (upgrade-mailbox u))
    (when (upgrade-ended u)
      ;; Ended meanwhile: its mailbox may have been dropped already.
      (discard-mailbox u))
    (and (kick-upgraded c u) (connection-upgraded-pending c))))

(defun connection-send-upgraded (c octets &key (start 0) (end (length octets)) (copy t))
  "Send OCTETS[START,END) on the upgraded connection C, after what was sent
before, from any thread, without waiting for the client: what the socket
does not take waits with C.  The octets are copied, unless COPY is NIL: the
caller gives them up (nothing may write to them after).  Returns the octets
now waiting to be taken by the client (CONNECTION-UPGRADED-PENDING), or NIL
when C is closed or closing: a send that finds more waiting than the send
limit (or, short of memory, +SHORT-OF-MEMORY-BACKLOG+) closes C, its
client does not read, as CONNECTION-SET-UPGRADED-ON-LIMIT says, and
answers NIL."
  (declare (type octets octets) (type fixnum start end))
  (let ((u (conn-slot c upgrade)))
    (cond ((or (null u) (upgrade-closing u) (upgrade-ended u)) nil)
          ((behind-p c u) (fall-behind c u) nil)
          ((< start end)
           (queue-upgraded c u (if copy
                                   (make-segment (subseq octets start end) 0 (- end start))
                                   (make-segment octets start end))))
          (t (and (kick-upgraded c u) (connection-upgraded-pending c))))))

(defun connection-send-shared (c shared)
  "Send the octets of SHARED (MAKE-SHARED-OCTETS) on the upgraded
connection C as CONNECTION-SEND-UPGRADED does, by reference: however many
connections they are sent on, they are in memory, and counted in the
memory account, once; each connection's backlog counts them in full."
  (let ((u (conn-slot c upgrade)))
    (cond ((or (null u) (upgrade-closing u) (upgrade-ended u)) nil)
          ((behind-p c u) (fall-behind c u) nil)
          (t (retain-shared-octets shared)
             (queue-upgraded c u (make-shared-segment shared))))))

(defun connection-set-upgraded-on-limit (c function)
  "How the upgraded connection C is closed when a send finds its client too
far behind (CONNECTION-SEND-UPGRADED): FUNCTION, called with no argument in
the sending thread, must not wait (a WebSocket cuts to its close frame,
CONNECTION-CUT-UPGRADED).  Without one, C is closed at once."
  (setf (upgrade-on-limit (conn-slot c upgrade)) function))

(defun connection-close-upgraded (c &key abort)
  "Close the upgraded connection C, from any thread: once what was sent is
taken by the client (the write side shut first, what the client still
sends read and dropped for a while, so that a close(2) with unread input
does not reset the connection before the client read the last octets); with
ABORT, at once, dropping what waits.  ON-CLOSE is called."
  (let ((u (conn-slot c upgrade)))
    (when u
      (if abort
          (setf (upgrade-closing u) :abort)
          (sb-ext:compare-and-swap (upgrade-closing u) nil :close))
      (kick-upgraded c u)))
  nil)

(defun connection-cut-upgraded (c last-words)
  "Close the upgraded connection C, from any thread, without waiting, with
LAST-WORDS (octets, given up: a WebSocket's close frame) as the last its
client gets: what waits for it and has not begun to go out is dropped, and
LAST-WORDS go after what has (at most the message, or the buffer of small
ones, the socket is taking), then C closes once its client has them, as
with CONNECTION-CLOSE-UPGRADED.  Nothing is read from C meanwhile.  A
client that reads nothing gets nothing more either: the caller aborts C
after a while.  NIL when C was cut already or has ended."
  (let ((u (conn-slot c upgrade)))
    (when (and u (not (upgrade-ended u))
               (null (sb-ext:compare-and-swap (upgrade-last-words u) nil last-words)))
      (sb-ext:compare-and-swap (upgrade-closing u) nil :close)
      (kick-upgraded c u)
      t)))

;;; The owner's side

(defconstant +copied-send-octets+ 512
  "Sends this small are copied into the connection's buffers, many in one
\(a segment and its reference would weigh about as much); larger ones wait
by reference.")

(defun drain-mailbox (c u)
  "Move what other threads sent into C's output, in the order sent, and send
what the socket takes (the caller owns C).  NIL when all of it went out."
  (let ((words (upgrade-last-words u)))
    (when (typep words 'octets)
      ;; Cut (CONNECTION-CUT-UPGRADED): its last words after the one
      ;; message the socket is taking, nothing else.
      (setf (upgrade-last-words u) t)
      (discard-mailbox u)
      (discard-unsent c :keep-first t)
      (connection-write-segment c (make-segment words 0 (length words)))))
  (when (eq (upgrade-last-words u) t)
    ;; Cut: a send that passed its check before the cut came after it, and
    ;; nothing goes after the last words.
    (discard-mailbox u))
  (let* ((segments (nreverse (take-mailbox u)))
         (segment nil))
    (unwind-protect
         (loop while segments
               do (setf segment (pop segments))
                  (let ((octets (segment-octets segment))
                        (start (segment-start segment))
                        (end (segment-end segment)))
                    (sb-ext:atomic-decf (upgrade-mailbox-bytes u) (- end start))
                    (cond ((= start end))
                          ((<= (- end start) +copied-send-octets+)
                           ;; Small: together in the output buffer, so that
                           ;; what was written in a row goes out in one send;
                           ;; behind queued output, in its last buffer.
                           (when (conn-slot c unsent)
                             (flush-output c))
                           ;; (The flush may have sent all that was queued.)
                           (if (conn-slot c unsent)
                               (queue-copy c octets start end)
                               (connection-write-octets c octets start end)))
                          ((and (null (segment-shared segment)) (null (conn-slot c unsent))
                                (<= (- end start) +buffer-size+))
                           (connection-write-octets c octets start end))
                          (t
                           ;; Large, or shared, or behind queued output: by
                           ;; reference, never copied.
                           (connection-write-segment c (shiftf segment nil))))
                    (when segment
                      (free-segment (shiftf segment nil)))))
      ;; A failed send: what was taken from the mailbox is let go of.
      (when segment (free-segment segment))
      (dolist (rest segments) (drop-mailbox-segment u rest))))
  (flush-output c)
  (or (null (conn-slot c unsent)) (send-unsent c)))

(defun upgraded-deadline (c u)
  (cond ((conn-slot c unsent) (output-deadline c))
        ;; Idle: nothing received for that long (what is sent does not count).
        ((plusp (upgrade-idle-ms u)) (+ (upgrade-last-input u) (upgrade-idle-ms u)))
        (t (+ (now-ms) +suspended-check-ms+))))

(defun park-upgraded (c u)
  "Give C back to epoll until the client sends, or the socket takes more of
its output; with no buffer held.  The caller owns C.  NIL when an event or
a sender marked it :DIRTY meanwhile: the caller still owns C.  Once the
engine stops, C is closed instead (true): the stop's last sweep may have
passed while a sender owned it."
  (unless (engine-running-p (connection-engine c))
    (close-connection c)
    (return-from park-upgraded t))
  (schedule c (upgraded-deadline c u))
  (release-buffers c)
  (when (conn-slot c unsent)
    (register-for-output c))
  (case (sb-ext:compare-and-swap (%conn-slot c state) :active :parked)
    (:active t)
    (:dirty (setf (connection-state c) :active) nil)
    (t (error "PARK-UPGRADED: ~A is not owned by this thread" c))))

(defun end-upgraded (c u)
  "The owner of C closes it as U's closing says, or (NIL) as the client
left it: gracefully, after its output, or at once."
  (if (or (eq (upgrade-closing u) :abort) (conn-slot c gone) (conn-slot c peer-closed))
      (close-connection c)
      ;; Shut the write side, read and drop for a while, then close.
      (reject-connection c nil)))

(defun read-upgraded (c u)
  "Read what the client sent and give it to U's ON-READ.  :EOF when the
client closed its side, :ERROR when the connection failed, :TURN when this
worker read its turn's worth, NIL when the socket is empty."
  (let ((buffer (ensure-inbuf c))
        (read 0))
    (declare (type fixnum read))
    (loop
      (multiple-value-bind (n errno) (connection-recv c buffer 0 (length buffer))
        (declare (type fixnum n))
        (cond ((plusp n)
               (setf (upgrade-last-input u) (now-ms))
               (deliver-upgraded c u buffer 0 n)
               (when (conn-slot c gone) (return :error))
               (when (upgrade-closing u)
                 ;; Closed meanwhile: nothing more is given to ON-READ.
                 (return nil))
               (incf read n)
               (cond ((>= read +upgraded-turn-octets+) (return :turn))
                     ((and (< n (length buffer)) (not (conn-slot c peer-closed)))
                      ;; Drained: more input raises a new event.  (After the
                      ;; client's FIN, none would: read on to the end.)
                      (return nil))))
              ((zerop n) (return :eof))
              ((= errno +eagain+) (return nil))
              (t (return :error)))))))

(defun deliver-upgraded (c u octets start end)
  "Call U's ON-READ on OCTETS[START,END), in this worker.  An error in it
is logged and aborts C."
  (let ((on-read (upgrade-on-read u)))
    (when (and on-read (< start end) (not (upgrade-closing u)))
      (setf (upgrade-reader u) sb-thread:*current-thread*)
      (unwind-protect
           (handler-case (funcall on-read octets start end)
             (serious-condition (e)
               (log-engine-error (connection-engine c) "Error reading ~A: ~A" c e)
               (setf (upgrade-closing u) :abort)))
        (setf (upgrade-reader u) nil)))))

(defun serve-upgraded (c)
  "A worker owns the upgraded connection C (an event, or the handler that
upgraded it just returned): give what the client sent to ON-READ, send what
waits, and park C again, or close it."
  (let ((u (conn-slot c upgrade)))
    (unless (upgrade-entered u)
      ;; Right after the handler: the octets after the request head first.
      (setf (upgrade-entered u) t
            (upgrade-reader u) nil
            (upgrade-last-input u) (now-ms))
      (sb-ext:atomic-incf (engine-upgraded (connection-engine c)))
      (sb-ext:atomic-incf (engine-upgrades (connection-engine c)))
      (with-connection-slots (inbuf in-start in-end) c
        (let ((start in-start) (end in-end))
          (setf in-start 0 in-end 0)
          (when (< start end)
            (deliver-upgraded c u inbuf start end)))))
    (handler-case
        (loop
          (let ((input (unless (or (upgrade-closing u)
                                   ;; Short of memory, and C holds much:
                                   ;; not read for now (overload.lisp).
                                   (pause-upgraded-p c))
                         (read-upgraded c u))))
            (when (eq input :error)
              (return (close-connection c)))
            (let ((sent (drain-mailbox c u)))
              (when (eq input :eof)
                (setf (conn-slot c peer-closed) t))
              (when (or (eq (upgrade-closing u) :abort)
                        (and sent (or (upgrade-closing u) (eq input :eof))
                             (nothing-waits-p u)))
                (return (end-upgraded c u)))
              (when (eq input :eof)
                ;; What is left goes out; nothing more will be read.
                (sb-ext:compare-and-swap (upgrade-closing u) nil :close))
              (cond ((eq input :turn)
                     (when (park-upgraded c u)
                       (return (group-requeue (connection-group c) (connection-token c)))))
                    ((park-upgraded c u) (return))))))
      (connection-error ()
        (note-client-abort (connection-engine c))
        (close-connection c)))
    nil))

(defun nothing-waits-p (u)
  "True when no send and no cut's last words wait in U's mailbox.  Read after
U's closing was seen: a sender pushes, or a cut sets its last words, before
it closes, and then kicks the owner (whose park fails, :DIRTY), so an owner
that drained before the push and saw the closing after it ends only once
this is true, and otherwise drains again."
  (and (null (upgrade-mailbox u))
       (not (typep (upgrade-last-words u) 'octets))))

(defun flush-upgraded-as-sender (c u)
  "A sending thread took the parked C (KICK-UPGRADED): send what waits, close
C if it is closing, and let go of it; input that came meanwhile is left to a
worker (the read callback runs only on workers)."
  (handler-case
      (let ((sent (drain-mailbox c u)))
        (cond ((or (eq (upgrade-closing u) :abort)
                   (and sent (upgrade-closing u) (nothing-waits-p u)))
               (end-upgraded c u))
              ((park-upgraded c u))
              (t
               ;; An event came (or another sender): a worker looks.
               (loop until (park-upgraded c u))
               (group-requeue (connection-group c) (connection-token c)))))
    (connection-error ()
      (note-client-abort (connection-engine c))
      (close-connection c))))

;;; Switching under a handler that keeps its thread (hunchensocket): the
;;; connection leaves the engine's epoll set and the worker leaves the pool.
;;; Its thread is charged to the memory account (kind :STACKS) for as long as
;;; the connection is open: what bounds how many switch is memory, as for
;;; everything else a client makes the server hold, and a burst of them is
;;; refused (503) before their stacks would exhaust it.

(defun connection-switch (c &key timeout-stream)
  "C switched protocols under a handler that keeps its thread and reads the
new protocol from C's stream (Hunchentoot's WebSocket libraries do): reads
and writes pass through from now on (CONNECTION-DETACH), and C still closes
when the handler is done with it.  The worker steps out of the pool
\(POOL-STEP-OUT): holding C for as long as its client likes costs the pool
none of its workers, as a thread per connection would.  TIMEOUT-STREAM, a
bufferless SB-SYS:FD-STREAM that the layer above lets the handler set a
timeout on (Hunchentoot's SET-TIMEOUTS), gives C's reads their timeout
once set (else READ-TIMEOUT-MS's).  The thread is charged to the memory
account until C closes (counted already when CONNECTION-MAY-SWITCH-P
allowed the switch; else whatever the account holds: the thread exists)."
  (connection-detach c)
  (unless (conn-slot c switched)        ; counted by CONNECTION-MAY-SWITCH-P
    (sb-ext:atomic-incf (engine-switched (connection-engine c)))
    (account-add :stacks (thread-octets)))
  (setf (conn-slot c switched) t
        (conn-slot c timeout-stream) timeout-stream)
  ;; Its handler's reads wait in poll(2): an event would only wake a worker
  ;; to mark C :DIRTY.
  (epoll-ctl (group-epfd (connection-group c)) +epoll-ctl-del+ (connection-fd c) 0 0)
  ;; The handler deadline bounds a request, not the protocol after it; and
  ;; no deadline of the housekeeper's is due while the handler reads.
  (disarm-handler-deadline c)
  (schedule c (+ (now-ms) (* 60 60 1000)))   ; an hour: nothing is due
  (unless (engine-running-p (connection-engine c))
    ;; A stop began before the switch: it shut the switched ones already.
    (shutdown-fd (connection-fd c) +shut-rdwr+))
  (pool-step-out)
  c)

(defun connection-switched-p (c)
  "True once C switched protocols under its handler (CONNECTION-SWITCH)."
  (eq (conn-slot c switched) t))

(defun connection-may-switch-p (c)
  "True when C may switch protocols under its handler, and then counted among
the engine's switched connections (each holding a thread) and its thread
charged to the memory account at once, so that handshakes at the same
moment cannot pass MAX-SWITCHED-THREADS or the account's limit together.
NIL past either, or from overload level 2 on: the caller answers 503."
  (let ((engine (connection-engine c)))
    (cond ((conn-slot c switched) t)
          ((refuses-upgrades-p) nil)   ; short of memory (overload.lisp, level 2)
          ((>= (sb-ext:atomic-incf (engine-switched engine)) (engine-max-switched engine))
           (sb-ext:atomic-decf (engine-switched engine))
           nil)
          ((not (account-charge :stacks (thread-octets)))
           (sb-ext:atomic-decf (engine-switched engine))
           (note-overload-refusal)
           nil)
          (t (setf (conn-slot c switched) :counted)
             t))))
