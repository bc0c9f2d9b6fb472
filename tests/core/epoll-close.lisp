;;;; epoll-close.lisp -- a connection the engine closes leaves the worker
;;;; group's epoll set (pool/) before its fd is closed.
;;;;
;;;; Why it matters (the fuzz test's rare 10 s hang): since Linux 6.10,
;;;; epoll_wait holds a reference to each ready file for the instant it polls
;;;; it.  If the connection's owner calls close(2) in that instant, the last
;;;; reference is the polling worker's, and the kernel releases the socket
;;;; (sends the FIN) only when that worker returns to user space.  A worker
;;;; whose poll found nothing to report does not return: it sleeps on in
;;;; epoll_wait, up to the pool's idle timeout (10 s).  Until then the client
;;;; sees neither an answer nor end of file, and the server counts the
;;;; connection closed.  Observed: the server's side in CLOSE-WAIT with no fd,
;;;; still listed in the group's epoll set.
;;;;
;;;; A test cannot make the kernel poll at that instant, but it can hold such
;;;; a reference itself: a dup of the server's fd keeps the socket alive past
;;;; the engine's close(2) exactly as the polling worker's reference does.
;;;; With it held, the engine must already have taken the socket out of the
;;;; epoll set, so that no worker can be left holding it.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: a connection's fd, group
;;;; and token, the engine's table and a group's epoll fd
;;;; (http/connection.lisp, pool/pool.lisp): the epoll set itself is what is
;;;; checked.

(in-package #:gallop-tests)

(in-suite core)

(defun epoll-set-holds-p (epfd token)
  "True if the epoll set EPFD of this process still holds an entry whose data
is TOKEN (read from /proc/self/fdinfo, one \"tfd:\" line per entry)."
  (with-open-file (in (format nil "/proc/self/fdinfo/~D" epfd))
    (loop for line = (read-line in nil)
          while line
          thereis (let ((data (search "data:" line)))
                    (and (eql 0 (search "tfd:" line))
                         data
                         (eql token (parse-integer line :start (+ data 5) :radix 16
                                                        :junk-allowed t)))))))

(defun engine-connection-from (engine client-port)
  "The engine's connection whose peer is the local port CLIENT-PORT, or NIL."
  (find-if (lambda (c) (and c (eql client-port (gallop.core:connection-remote-port c))))
           (gallop.core::engine-table engine)))

(test a-closed-connection-is-out-of-the-epoll-set-before-its-fd-closes
  (with-engine (engine port)
    (let* ((socket (connect port))
           (c (wait-until (lambda () (engine-connection-from
                                      engine (usocket:get-local-port socket)))))
           (epfd (and c (gallop.core::group-epfd (gallop.core::connection-group c))))
           (token (and c (gallop.core::connection-token c)))
           ;; The second reference to the server's socket: what a worker
           ;; polling it in epoll_wait holds for an instant.
           (extra (and c (sb-posix:dup (gallop.core::connection-fd c)))))
      (unwind-protect
           (progn
             (is (not (null c)) "the engine never adopted the connection")
             ;; The engine tables a connection before it adds it to the set.
             (is (wait-until (lambda () (epoll-set-holds-p epfd token)))
                 "the parked connection is not in the epoll set")
             ;; The input that hung: part of a request line, then the client's FIN.
             ;; The server reads it, reads end of file, and closes.
             (send socket "PO")
             (usocket:socket-shutdown socket :output)
             (is (wait-until (lambda () (= 1 (engine-stat engine :closed)))))
             (is (not (epoll-set-holds-p epfd token))
                 "the closed connection is still in the workers' epoll set: a worker ~
                  polling it as it closed would hold its last reference, and the ~
                  client would get no FIN until that worker's epoll_wait returns"))
        (when extra (sb-posix:close extra)))
      ;; Our reference gone, the socket is released: the client sees end of
      ;; file and not a byte.
      (unwind-protect (is (closed-by-peer-p socket))
        (usocket:socket-close socket)))))
