;;;; accept.lisp -- new connections: accepted on the engine's listen socket
;;;; by the housekeeper, or handed over by the layer above (ENGINE-ADOPT-FD);
;;;; answered 503 without a worker when the engine is overloaded.

(in-package #:gallop.core)

(defun free-workers (engine)
  "Idle workers that no fresh connection was handed to in this tick of the
housekeeper (CLAIMS, reset every tick): a burst accepted at once is not all
taken for free workers' work, and a silent connection handed to an idle
worker stops counting against it within a tick."
  (max 0 (- (pool-idle-count (engine-pool engine)) (engine-claims engine))))

(defun engine-overloaded-p (engine)
  "True when the connections waiting for a worker (PENDING) fill every
worker that could still take one (free workers, and those the pool may still
start) plus the queue of MAX-QUEUE: a new connection would only wait, so it
gets 503 at once instead.  A connection waits for a worker when its whole
request head was there while no worker was free, until a worker serves it
\(ENGINE-ADOPT-FD).  One that has sent nothing, or part of a head, holds no
worker and never counts: its limits are the fds, the head budget and the
header timeout, so that clients who open connections and stay silent cannot
make the server refuse everyone else (doc/design.md, \"Silent connections
are not work\")."
  (let ((pool (engine-pool engine)))
    (>= (engine-pending engine)
        (+ (engine-max-queue engine)
           (free-workers engine)
           (max 0 (- (pool-max-threads pool) (pool-thread-count pool)))))))

(defun engine-adopt-fd (engine fd &key remote-address remote-port close-hook user-data
                                    (nonblocking nil) late)
  "Take a freshly accepted socket FD into ENGINE: it waits in epoll until its
first request head is complete (in its group's set; or, while no worker is
free and it has sent nothing, in the housekeeper's: WATCH-SILENT).
CLOSE-HOOK, if given, is called to release the fd instead of close(2).
LATE: FD was accepted by a soft stop's FINAL-ACCEPT, and is served although
the engine is stopping.  Returns the connection, or NIL if it was refused
\(engine not running, fd beyond the table)."
  (unless nonblocking (set-nonblocking fd))
  (when (minusp (engine-listen-fd engine))
    ;; Accepted by the layer above: sockets accepted from the engine's own
    ;; listen socket inherit this from it (ENGINE-START).
    (set-notsent-lowat fd +kernel-unsent-bytes+))
  (let ((table (engine-table engine)))
    (when (or (not (or (engine-running-p engine) late)) (>= fd (length table)))
      (if close-hook (funcall close-hook) (close-fd fd))
      (return-from engine-adopt-fd nil))
    (let ((c (make-connection engine fd :remote-address remote-address
                                        :remote-port remote-port
                                        :close-hook close-hook :user-data user-data)))
      (schedule c (+ (now-ms) (engine-header-timeout-ms engine)))
      (sb-ext:atomic-incf (engine-accepted engine))
      (setf (svref table fd) c)
      (multiple-value-bind (ok errno)
          (cond ((plusp (free-workers engine))
                 (hand-to-workers c :claim))
                ((minusp (engine-housekeeper-epfd engine))
                 (hand-to-workers c :pending))
                (late
                 ;; The housekeeper is ending: nobody would watch C for it.
                 (hand-to-workers c (and (eq (peek-fresh c) :complete) :pending)))
                (t
                 ;; No worker is free: is its request here?
                 (ecase (peek-fresh c)
                   (:complete (hand-to-workers c :pending))
                   (:partial (hand-to-workers c nil))
                   (:none (watch-silent c)))))
        (unless ok
          (log-engine-error engine "epoll_ctl ADD of fd ~D failed: errno ~D" fd errno)
          (setf (connection-state c) :active)
          (close-connection c)
          (return-from engine-adopt-fd nil)))
      c)))

(defun peek-fresh (c)
  "PEEK-REQUEST on the fresh connection C; on TLS, any octet is :COMPLETE
\(a handshake is a worker's work as a request is)."
  (let ((what (peek-request (connection-fd c))))
    (if (and (eq what :partial) (connection-tls-p c)) :complete what)))

(defun hand-to-workers (c count)
  "Put the fresh connection C in its group's epoll set, for a worker to
serve.  COUNT :CLAIM: a worker was free, and is no longer free for the next
connection in this tick (FREE-WORKERS); :PENDING: none was and C's whole
request head is here, so C waits for one, counted in PENDING until a worker
takes it; NIL: C has sent part of a head, or nothing, and costs no worker
until the rest comes.  Returns what EPOLL-CTL does."
  (let ((engine (connection-engine c)))
    (ecase count
      (:claim (sb-ext:atomic-incf (engine-claims engine)))
      (:pending (setf (conn-slot c queued) t)
       (sb-ext:atomic-incf (engine-pending engine)))
      ((nil)))
    (setf (connection-state c) :parked)
    (epoll-ctl (group-epfd (connection-group c)) +epoll-ctl-add+ (connection-fd c)
               +connection-events+ (connection-token c))))

(defun watch-silent (c)
  "Keep the fresh connection C, whose client has sent nothing yet while no
worker is free, in the housekeeper's epoll set until it sends (:WAITING):
then WAKE-SILENT hands it to the workers.  Returns what EPOLL-CTL does."
  (setf (connection-state c) :waiting)
  (epoll-ctl (engine-housekeeper-epfd (connection-engine c)) +epoll-ctl-add+ (connection-fd c)
             (logior +epollin+ +epollrdhup+ +epolloneshot+) (connection-token c)))

(defun wake-silent (c)
  "In the housekeeper: the :WAITING connection C has sent its first octets
\(or hung up).  Hand it to the workers; or, if its whole request head is
here and the engine is overloaded now, answer it 503 as a new connection
would be, so that no more requests wait than MAX-QUEUE allows however their
octets and their accept were ordered."
  (let ((engine (connection-engine c)))
    (epoll-ctl (engine-housekeeper-epfd engine) +epoll-ctl-del+ (connection-fd c) 0 0)
    (let ((what (peek-fresh c)))
      (if (and (eq what :complete) (engine-overloaded-p engine))
          (progn
            (sb-ext:atomic-incf (engine-shed engine))
            (setf (connection-state c) :active)
            (reject-connection c (response-503 engine) :registered nil))
          (multiple-value-bind (ok errno)
              (hand-to-workers c (cond ((plusp (free-workers engine)) :claim)
                                       ((eq what :complete) :pending)))
            (unless ok
              (log-engine-error engine "epoll_ctl ADD of fd ~D failed: errno ~D"
                                (connection-fd c) errno)
              (setf (connection-state c) :active)
              (close-connection c)))))))

(defun engine-shed-fd (engine fd &key close-hook late remote-address remote-port)
  "Answer the fresh socket FD with 503 and Retry-After, without a worker, and
close it after the client has read the answer.  Once ENGINE stopped running
\(unless LATE, see ENGINE-ADOPT-FD) FD is only closed: nothing would watch it.
REMOTE-ADDRESS and REMOTE-PORT, the peer's, are for the answer's log."
  (set-nonblocking fd)
  (sb-ext:atomic-incf (engine-shed engine))
  (sb-ext:atomic-incf (engine-accepted engine))
  (let ((table (engine-table engine)))
    (if (or (>= fd (length table)) (not (or late (engine-running-p engine))))
        (if close-hook (funcall close-hook) (close-fd fd))
        (let ((c (make-connection engine fd :close-hook close-hook
                                            :remote-address remote-address
                                            :remote-port remote-port)))
          (setf (conn-slot c fresh) nil
                (connection-state c) :active
                (svref table fd) c)
          (reject-connection c (response-503 engine) :registered nil)))))


(defun accept-pending (engine &key late)
  "Accept the connections waiting on the listen socket, at most 512.  Returns
:DRAINED when none is left, :PAUSED when out of fds (see below).  LATE: see
ENGINE-ADOPT-FD."
  (loop repeat 512
        ;; A stop began: what waits is left to the final accept, or to the
        ;; next process on a passed socket.
        until (not (or late (engine-running-p engine)))
        do (multiple-value-bind (fd address-or-errno port) (accept-connection (engine-listen-fd engine))
             (cond ((>= fd 0)
                    (if (engine-overloaded-p engine)
                        (engine-shed-fd engine fd :late late
                                                  :remote-address address-or-errno
                                                  :remote-port port)
                        (engine-adopt-fd engine fd :remote-address address-or-errno
                                                   :remote-port port :nonblocking t
                                                   :late late)))
                   ((= address-or-errno +eagain+) (return :drained))
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

(defun final-accept (engine)
  "A soft stop's end of the engine's own listen socket, in the housekeeper:
accept every connection in its queue, to be served (with Connection: close),
then shut it.  Shut, a listening socket leaves its SO_REUSEPORT group, so
the kernel sends new connections to the other sockets on its port (or
refuses them) instead of queueing them here for a close that would reset
them.  One arriving between the last accept and the shutdown is still reset,
unless net.ipv4.tcp_migrate_req moves it (doc/design.md, \"A soft stop
empties its own listen socket\")."
  (let ((fd (engine-listen-fd engine)))
    (when (>= fd 0)
      (loop repeat 100
            until (member (accept-pending engine :late t) '(:drained :paused)))
      (shutdown-fd fd +shut-rd+))))
