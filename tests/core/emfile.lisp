;;;; emfile.lisp -- out of file descriptors: a server whose fd limit is tiny
;;;; stops accepting (no busy loop, no crash) and takes the waiting clients
;;;; once fds free up.  The server runs in its own process, started under
;;;; prlimit, so the test process keeps its own limit.

(in-package #:gallop-tests)

(in-suite core)

(defun start-bench-server (kind port &key fd-limit)
  "bench/server.lisp serving KIND (\"native\", \"gallop\", ...) on PORT, in a
process of its own (its pool sees its own CPU use, not this test's), under
an fd limit of FD-LIMIT when given.  Returns the process and its first line
of output, \"READY <pid>\" once it listens (see bench/server.lisp)."
  (let* ((command (list "scripts/lisp.sh" "--load" "bench/server.lisp"
                        "--end-toplevel-options" kind (princ-to-string port) "0"))
         (process (sb-ext:run-program
                   (if fd-limit "prlimit" "/bin/sh")
                   (if fd-limit
                       (cons (format nil "--nofile=~D:~D" fd-limit fd-limit) command)
                       command)
                   :search t :wait nil :input :stream :output :stream :error nil
                   :directory (asdf:system-source-directory "gallop"))))
    (values process (read-line (sb-ext:process-output process) nil ""))))

(defun start-limited-server (port fd-limit)
  "A native Gallop server (bench/server.lisp) on PORT in a child process
whose fd limit is FD-LIMIT.  Returns the process once it answers."
  (values (start-bench-server "native" port :fd-limit fd-limit)))

(defun limited-server-stats (process)
  "GALLOP:STATS of the child server (bench/server.lisp's \"stats\" command)."
  (write-line "stats" (sb-ext:process-input process))
  (finish-output (sb-ext:process-input process))
  (let ((line (read-line (sb-ext:process-output process) nil "")))
    (ignore-errors (let ((*read-eval* nil))
                     (read-from-string line t nil :start (length "STATS "))))))

(defun stop-limited-server (process)
  (ignore-errors (write-line "quit" (sb-ext:process-input process))
                 (finish-output (sb-ext:process-input process)))
  (sb-ext:process-wait process)
  (sb-ext:process-close process))

(defun free-port ()
  (let ((s (usocket:socket-listen "127.0.0.1" 0 :reuse-address t)))
    (prog1 (usocket:get-local-port s) (usocket:socket-close s))))

(test out-of-fds-pauses-accepting-and-recovers
  (let* ((port (free-port))
         (server (start-limited-server port 64))
         (sockets '()))
    (unwind-protect
         (progn
           (is (= 200 (response-status (get-request port "/yo"))))
           ;; More clients than the server has fds: the kernel completes their
           ;; connections, but the server can accept only some of them.
           (dotimes (i 80)
             (let ((s (connect port :timeout 15)))
               (push s sockets)
               (send s (crlf "GET /yo HTTP/1.1" "Host: x"))))
           (setf sockets (nreverse sockets))
           (sleep 1)
           (is (sb-ext:process-alive-p server))
           ;; It really ran out: it holds fewer connections than clients.
           (let ((open (getf (limited-server-stats server) :open)))
             (is (and open (< open 80)) "the server holds ~A connections" open))
           ;; Read the answered ones and close them; that frees the server's fds,
           ;; and it takes the clients that were waiting.
           (let ((answered 0))
             (dolist (s sockets)
               (let ((r (handler-case (read-response s) (error () nil))))
                 (when (and r (= 200 (response-status r)))
                   (incf answered)))
               (usocket:socket-close s))
             (setf sockets '())
             (is (= 80 answered) "~D of 80 clients were answered" answered))
           (is (= 200 (response-status (get-request port "/yo"))))
           (is (sb-ext:process-alive-p server)))
      (mapc #'usocket:socket-close sockets)
      (stop-limited-server server))))
