;;;; accept.lisp -- new connections: accepted on the engine's listen socket
;;;; by the housekeeper, or handed over by the layer above (ENGINE-ADOPT-FD);
;;;; answered 503 without a worker when the engine is overloaded.

(in-package #:gallop.core)

(defun engine-overloaded-p (engine)
  "True when the accepted connections no worker has served yet fill every
worker that could still take one (idle workers, and those the pool may still
start) plus the queue of MAX-QUEUE: a new connection would only wait, so it
gets 503 at once instead."
  (let ((pool (engine-pool engine)))
    (>= (engine-pending engine)
        (+ (engine-max-queue engine)
           (pool-idle-count pool)
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
          (epoll-ctl (group-epfd (connection-group c)) +epoll-ctl-add+ fd
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
