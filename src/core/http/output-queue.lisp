;;;; output-queue.lisp -- the output a connection's socket did not take
;;;; yet: its queue of segments, their charge in the memory account, and the
;;;; waits of a writer whose client reads too slowly.
;;;;
;;;; Writes never wait for a client (output.lisp writes through here): what
;;;; the socket does not take is queued with the connection and sent as the
;;;; socket drains, bounded by the write timeout and the minimum data rate.
;;;; The rules and invariants follow.

(in-package #:gallop.core)

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

(defun output-deadlines (c)
  "C's waiting output: the end of its write timeout from the last progress,
and of the minimum rate's period (or NIL)."
  (values (+ (conn-slot c out-progress) (engine-write-timeout-ms (connection-engine c)))
          (output-rate-deadline c)))

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
