;;;; lifecycle.lisp -- a connection's states: registered, parked in epoll,
;;;; rejected, closed.
;;;;
;;;; A connection is :PARKED (in epoll, no thread), :WAITING (fresh, and
;;;; silent while no worker was free: in the housekeeper's epoll set until it
;;;; sends, see WATCH-SILENT), :ACTIVE (a worker or, once suspended, an
;;;; answering thread owns it), :DIRTY (active, and an event came meanwhile:
;;;; its owner reads again before parking), :DRAINING (rejected:
;;;; the housekeeper reads and discards until it closes), :DETACHED (the
;;;; handler kept the stream) or :CLOSED.  Every move out of :PARKED is a
;;;; compare-and-swap, so exactly one thread takes a parked connection.
;;;; Every deadline goes into the engine's timing wheel (wheel.lisp); the
;;;; housekeeper advances it every +TICK-MS+ and expires what came due
;;;; (housekeeper.lisp).

(in-package #:gallop.core)

(defconstant +connection-events+ (logior +epollin+ +epollrdhup+ +epollet+)
  "A connection is registered once, edge-triggered: every arrival of input
raises an event, and nothing needs re-arming after a request (see
DISPATCH-EVENT and PARK for how an event that finds the connection busy is
kept).")



(defun next-token (engine fd)
  ;; 30 bits of generation keep the token a fixnum (see pool/groups.lisp's queue).
  (logior (ash (logand (sb-ext:atomic-incf (engine-generation engine)) #x3fffffff) 32)
          fd))

(defun make-connection (engine fd &key remote-address remote-port close-hook user-data)
  (let ((group (pool-next-group (engine-pool engine))))
    (make-instance 'connection :fd fd :engine engine :token (next-token engine fd)
                               :group group
                               :tally (engine-tally engine (and group (group-index group)))
                               :raw (engine-raw-p engine)
                               :tls (if (engine-tls engine) -1 0)
                               :remote-address remote-address :remote-port (or remote-port 0)
                               :close-hook close-hook :user-data user-data)))


(defun schedule (c deadline)
  "Set C's deadline and make sure the housekeeper looks at C by then."
  (setf (connection-deadline c) deadline)
  (wheel-schedule (engine-wheel (connection-engine c)) c deadline))

(defconstant +suspended-check-ms+ (* 60 60 1000)
  "How often the housekeeper looks at a suspended request's parked
connection: never closes it (the app answers when it answers), so rarely.")

(defun unfresh (c)
  "A worker serves C (or C closes): it is no longer fresh, nor queued."
  (when (conn-slot c fresh)
    (setf (conn-slot c fresh) nil)
    (when (shiftf (conn-slot c queued) nil)
      (sb-ext:atomic-decf (engine-pending (connection-engine c))))))


;;; Closing, parking, rejecting

(defun close-connection (c)
  "Close C for good.  The caller owns C (it is :ACTIVE, :DRAINING or
:DETACHED, or the caller won a CAS from :PARKED)."
  (let ((engine (connection-engine c))
        (fd (connection-fd c)))
    (unless (eq (connection-state c) :closed)
      ;; Out of its group's epoll set before the fd closes.  Since Linux
      ;; 6.10 epoll_wait holds a reference to a ready file while it polls
      ;; it; a close(2) in that instant leaves the last reference, and so
      ;; the socket's release (its FIN), to that worker, which does it only
      ;; on its return to user space, and a worker whose poll found nothing
      ;; sleeps on in epoll_wait (up to the pool's idle timeout, 10 s): the
      ;; client waits that long for an answer or end of file.  EPOLL_CTL_DEL
      ;; waits for such a poll to end, so the close below drops the last
      ;; reference itself.  (Draining, detached and shed connections are not
      ;; in that set.)
      (let ((epfd (case (connection-state c)
                    ((:active :dirty :parked) (group-epfd (connection-group c)))
                    (:waiting (engine-housekeeper-epfd engine))
                    (t -1))))
        (when (>= epfd 0)
          (epoll-ctl epfd +epoll-ctl-del+ fd 0 0)))
      (unfresh c)
      (uncharge-head c)
      (release-spool c)
      (note-upgrade-ended c)
      (when (conn-slot c switched)
        ;; Its thread: counted, and charged (upgrade.lisp).
        (sb-ext:atomic-decf (engine-switched engine))
        (account-add :stacks (- (thread-octets))))
      (free-tls c)
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

(defun give-back-upgraded (engine u kind octets)
  "Give back at most OCTETS of U's count of KIND (all of it when OCTETS is
NIL), once: the holder and the end of the connection may both try."
  (loop
    (let* ((old (if (eq kind :inflate) (upgrade-inflated u) (upgrade-charged u)))
           (new (if octets (max 0 (- old octets)) 0)))
      (when (= old (if (eq kind :inflate)
                       (sb-ext:compare-and-swap (upgrade-inflated u) old new)
                       (sb-ext:compare-and-swap (upgrade-charged u) old new)))
        (let ((back (- old new)))
          (when (plusp back)
            (body-bytes-incf engine (- back))
            (account-add kind (- back))))
        (return t)))))

(defun take-mailbox (u)
  "What U's mailbox holds, newest first, taken from it at once."
  (loop for old = (upgrade-mailbox u)
        when (eq old (sb-ext:compare-and-swap (upgrade-mailbox u) old nil))
          return old))

(defun drop-mailbox-segment (u segment)
  "Let go of SEGMENT, taken from U's mailbox and not sent, and of its count."
  (let ((n (- (segment-end segment) (segment-start segment))))
    (sb-ext:atomic-decf (upgrade-mailbox-bytes u) n)
    (free-segment segment)))

(defun discard-mailbox (u)
  "Drop what U's mailbox holds (its connection ended, or was cut)."
  (dolist (segment (take-mailbox u))
    (drop-mailbox-segment u segment)))

(defun note-upgrade-ended (c)
  "C, upgraded, is closing: count it, and call its ON-CLOSE once, on a
worker (a timer due now), or in this thread when the engine is stopping."
  (let ((u (conn-slot c upgrade)))
    (when (and u (null (sb-ext:compare-and-swap (upgrade-ended u) nil t)))
      ;; The closed connection lets go of the layer above, and so of what
      ;; that holds for it (a WebSocket's message half read): others may
      ;; still hold the connection a while (a stale entry of the timing
      ;; wheel, up to the wheel's span), while its budget is given back now.
      (let ((engine (connection-engine c))
            (on-close (shiftf (upgrade-on-close u) nil)))
        (setf (upgrade-on-read u) nil
              (upgrade-on-shed u) nil
              (upgrade-on-limit u) nil)
        (when (upgrade-entered u)
          (sb-ext:atomic-decf (engine-upgraded engine)))
        (give-back-upgraded engine u :messages nil)
        (give-back-upgraded engine u :inflate nil)
        (discard-mailbox u)
        (when on-close
          (flet ((call ()
                   (handler-case (funcall on-close)
                     (serious-condition (e)
                       (log-engine-error engine "Error closing ~A: ~A" c e)))))
            (if (engine-running-p engine)
                (pool-submit (engine-pool engine) #'call)
                (call))))))))

(defun register-for-output (c)
  "Make C's epoll registration include EPOLLOUT, once and for good:
edge-triggered, EPOLLOUT raises an event only when the socket drains after
a send found it full."
  (unless (conn-slot c out-registered)
    (setf (conn-slot c out-registered) t)
    (epoll-ctl (group-epfd (connection-group c)) +epoll-ctl-mod+ (connection-fd c)
               (logior +connection-events+ +epollout+) (connection-token c))))

(defun park (c &optional output)
  "Give the connection back to epoll until its next request arrives (OUTPUT:
until the socket takes more of its unsent output, see OUTPUT-PARKED-P).  The
caller owns C.  Returns true, or NIL when an event came while C was busy
(input arrived, or with OUTPUT the socket drained) and marked it :DIRTY: the
caller still owns C and must read (or send) again."
  (let ((engine (connection-engine c)))
    (with-connection-slots (in-start in-end head-started boundary stream-closed) c
      (setf boundary nil stream-closed nil
            ;; A mark of the overload manager's is for the request it saw.
            (conn-slot c shed) nil)
      (let ((now (now-ms)))
        (cond (output
               ;; The write timeout, from the last time the client read, or
               ;; sooner when it reads under the minimum rate.
               (schedule c (output-deadline c)))
              ((request-gathering (connection-request c))
               ;; Reading a body (GATHER-BODY): the read timeout from the
               ;; last octets, or sooner under the minimum rate.
               (schedule c (multiple-value-call #'earliest (body-deadlines c))))
              ((and (= in-start in-end) (not (tls-handshaking-p c)))
               (setf head-started nil)
               (schedule c (+ now (engine-idle-timeout-ms engine))))
              (t
               ;; The header timeout for the whole head, or sooner when what
               ;; came of it so far is under the minimum rate.
               (unless head-started (setf head-started now))
               (schedule c (multiple-value-call #'earliest (head-deadlines c))))))
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
      (when output
        (register-for-output c))
      ;; From here on, an event (or the housekeeper, once the deadline
      ;; passes) may take C.  Input that came while C was busy left it
      ;; :DIRTY: keep it and read again, or that input would wait for an
      ;; event that already came.
      (case (sb-ext:compare-and-swap (%conn-slot c state) :active :parked)
        (:active t)
        (:dirty (setf (connection-state c) :active)
         nil)
        (t (error "PARK: ~A is not owned by this worker" c))))))

(defun reject-connection (c response &key (registered t))
  "Send RESPONSE (an error the engine writes itself; NIL: nothing more), shut
the write side and let the housekeeper drain and close C.  The caller owns C."
  (let* ((engine (connection-engine c))
         (fd (connection-fd c)))
    (unfresh c)
    (uncharge-head c)
    (release-spool c)
    (note-upgrade-ended c)
    (discard-unsent c)
    (when registered
      (epoll-ctl (group-epfd (connection-group c)) +epoll-ctl-del+ fd 0 0))
    ;; (On TLS, nothing before the handshake is done: no answer can be read
    ;; then.  After the answer, close_notify.)
    (when (and response (not (tls-handshaking-p c)))
      ;; One send, never waiting: what the socket does not take is lost.
      (note-refusal c response (max 0 (connection-send c response 0 (length response)))))
    (end-tls c)
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


(defun reject (c response)
  (sb-ext:atomic-incf (engine-rejected (connection-engine c)))
  (reject-connection c response))
