;;;; switched.lisp -- thousands of WebSockets in hunchensocket's shape
;;;; (tests/child/switched-server.lisp: a handler that answers 101 and reads
;;;; frames in its own thread) on GALLOP:EASY-ACCEPTOR, in a child process,
;;;; so that a crash fails the test instead of ending the test runner.

(in-package #:gallop-tests)

(in-suite stress)

(defun start-switched-child (&key settings heap)
  "Start tests/child/switched-server.lisp with SETTINGS (a string of
GALLOP:TASKMASTER initargs, or NIL) and HEAP (SBCL's --dynamic-space-size,
or NIL: SBCL's default); return the process and its port."
  (let* ((process (sb-ext:run-program
                   "sbcl" (append (and heap (list "--dynamic-space-size" heap))
                                  (list "--noinform" "--non-interactive" "--no-userinit"
                                        "--eval" "(require :asdf)"
                                        "--eval" "(push (uiop:getcwd) asdf:*central-registry*)"
                                        "--eval" "(setf *compile-verbose* nil *compile-print* nil)"
                                        "--load" "tests/child/switched-server.lisp"
                                        "--end-toplevel-options")
                                  (and settings (list settings)))
                   :search t :wait nil :input :stream :output :stream :error nil
                   :directory (asdf:system-source-directory "gallop")))
         (line (read-line (sb-ext:process-output process) nil "")))
    (values process (and (uiop:string-prefix-p "READY " line)
                         (parse-integer line :start 6)))))

(defun child-number (process command)
  "The number the child answers to COMMAND (\"maker\" -> \"MAKER 12\": 12), or
NIL when it does not answer (it died)."
  (let* ((answer (child-command process command))
         (space (position #\Space answer)))
    (and space (parse-integer answer :start (1+ space) :junk-allowed t))))

(defun open-echo-websockets (port most)
  "Open WebSockets to the child's /echo until one is refused or MOST are
open: the open ones' sockets, and the status of the refused one (NIL when
none was)."
  (let ((sockets '()))
    (loop repeat most
          do (let ((socket (connect port :timeout 30)))
               (send socket (ws-handshake "/echo"))
               (let* ((response (read-response socket :head-only t))
                      (status (and response (response-status response))))
                 (unless (eql 101 status)
                   (usocket:socket-close socket)
                   (return-from open-echo-websockets (values sockets (or status :none))))
                 (push socket sockets))))
    (values sockets nil)))

(defun burst-of-first-messages (sockets)
  "Send one text frame on every one of SOCKETS, all before reading any answer,
then read each one's echo: how many got their own text back, byte for byte."
  (loop for socket in sockets
        for i from 0
        do (ws-send socket (ws-frame 1 (octets (format nil "m~D" i)))))
  (loop for socket in sockets
        for i from 0
        count (let ((expected (server-frame 1 (octets (format nil "m~D" i)))))
                (equalp (coerce expected '(simple-array (unsigned-byte 8) (*)))
                        (read-octets socket (length expected) :timeout 120)))))

(test a-burst-of-first-messages-at-the-default-cap
  "With the default settings and SBCL's default heap, as many hunchensocket-
shaped WebSockets as the memory account lets switch (the next is refused
with 503), then one first message on each at the same moment: the process
lives and every one is echoed.  Each first message is the handler's first
call of a constructor and of generic functions in that thread."
  (raise-fd-limit)
  (multiple-value-bind (process port) (start-switched-child)
    (let ((sockets '()))
      (unwind-protect
           (progn
             (is (integerp port) "the child server did not start")
             (multiple-value-bind (open refused) (open-echo-websockets port 20000)
               (setf sockets open)
               (is (eql 503 refused) "not refused once the account was full: ~S" refused)
               (format t "~&    ~D switched WebSockets held at the default cap (~A)~%"
                       (length sockets) (child-command process "stats")))
             (is (plusp (length sockets)))
             (let ((answered (burst-of-first-messages sockets)))
               (is (= (length sockets) answered)
                   "~D of ~D first messages answered" answered (length sockets)))
             (let ((heap (child-number process "heap")))
               (is (integerp heap) "the child died in the burst")
               (format t "~&    heap after a full GC: ~,1F MiB~%" (/ (or heap 0) 1048576))))
        (mapc #'usocket:socket-close sockets)
        (end-child-server process)))))

(defun light-load (port seconds)
  "A request every 20 ms for SECONDS on one keep-alive connection: enough
to keep the pool's maker sampling (it rests after 100 ms without an event)."
  (let ((socket (connect port)))
    (unwind-protect
         (loop with end = (+ (get-internal-real-time)
                             (* seconds internal-time-units-per-second))
               while (< (get-internal-real-time) end)
               do (send socket (crlf "GET /plain HTTP/1.1" "Host: x"))
                  (read-response socket)
                  (sleep 0.02))
      (usocket:socket-close socket))))

(defun maker-ticks-under-light-load (process port seconds)
  "The CPU time (clock ticks) the child's maker spends over SECONDS of
LIGHT-LOAD."
  (let ((before (child-number process "maker")))
    (light-load port seconds)
    (- (child-number process "maker") before)))

(test idle-switched-threads-cost-the-maker-nothing
  "The pool's maker samples every 5 ms while there is work; a sample reads the
process's CPU time, which Linux would sum over every thread of the process.
Under the same light load, its CPU time with 2,000 idle switched WebSockets
\(2,000 more threads) is within twice, and two ticks, of what it is without
them, in the same process (the control).  At rest, it rests with them as
without."
  (raise-fd-limit)
  ;; Room in the memory account for 2,000 switched threads' stacks: a heap
  ;; (reserved, not used) that large.
  (multiple-value-bind (process port) (start-switched-child :heap "32GB")
    (let ((sockets '()))
      (unwind-protect
           (progn
             (is (integerp port) "the child server did not start")
             (light-load port 1)        ; the first requests' work, out of the way
             (let ((control (maker-ticks-under-light-load process port 5)))
               (multiple-value-bind (open refused) (open-echo-websockets port 2000)
                 (setf sockets open)
                 (is (null refused) "refused: ~S" refused)
                 (is (= 2000 (length sockets))))
               (sleep 2)
               (let ((with (maker-ticks-under-light-load process port 5))
                     (resting (let ((before (child-number process "maker")))
                                (sleep 5)
                                (- (child-number process "maker") before))))
                 (format t "~&    maker CPU over 5 s of light load: ~D ticks without, ~D with ~
                            2,000 idle switched WebSockets; ~D ticks in 5 s at rest~%"
                         control with resting)
                 (is (<= with (+ 2 (* 2 control)))
                     "the maker used ~D ticks with 2,000 idle switched WebSockets, ~D without"
                     with control)
                 (is (<= resting (+ 2 control))
                     "the maker used ~D ticks at rest with 2,000 idle switched WebSockets"
                     resting))))
        (mapc #'usocket:socket-close sockets)
        (end-child-server process)))))
