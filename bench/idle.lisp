;;;; idle.lisp -- the idle-connections helper: open N keep-alive connections to
;;;; 127.0.0.1:PORT, send one GET /yo on each and read its response, then hold
;;;; them open, idle, until told to stop.
;;;;
;;;;   scripts/lisp.sh --load bench/idle.lisp --end-toplevel-options PORT N [TIMEOUT-S [BATCH]]
;;;;
;;;; TIMEOUT-S (default 60) bounds the opening; BATCH (default 32) is how many
;;;; connections are opened at once (see *BATCH*).
;;;;
;;;; Protocol with the harness (bench/run.lisp), on standard input/output:
;;;;   once every connection is open (or failed, or TIMEOUT-S passed) it prints
;;;;     HELD held=K failed=F connect=C non2xx=S closed=E timeout=T ms=M
;;;;   "check" -> "ALIVE A": how many held connections the server has not
;;;;              closed (a held connection that became readable was closed
;;;;              by the server: it never sends anything unasked);
;;;;   "quit" or end of file -> close everything and exit.
;;;; It raises its own soft RLIMIT_NOFILE to the hard limit first (10000
;;;; connections need more than the usual soft limit of 1024).

(require :sb-bsd-sockets)
(load (merge-pathnames "process.lisp" (or *load-truename* *default-pathname-defaults*)))

(defpackage #:gallop-bench-idle
  (:use #:common-lisp #:gallop-bench-process))
(in-package #:gallop-bench-idle)

(defvar *protocol* sb-sys:*stdout*)
(setf *standard-output* *error-output*)



(defvar *batch* 32
  "Connections opened at once (the fourth argument).  Below Hunchentoot's default listen backlog
(50), which the stock acceptor keeps even with GALLOP:TASKMASTER: a burst of
100 connects overflows it, SYNs are dropped and retried after a second (and
a few connects fail), so opening 10000 connections would take minutes and
the first ones would reach the idle timeout before the last were open.
This scenario measures holding idle connections, not connection bursts.")

(defparameter *request*
  (map '(vector (unsigned-byte 8)) #'char-code
       (format nil "GET /yo HTTP/1.1~C~CHost: 127.0.0.1~C~C~C~C"
               #\Return #\Newline #\Return #\Newline #\Return #\Newline)))

(defvar *errors* (make-hash-table :test #'equal)
  "How often each kind of error happened while opening connections.")

(defun note-error (e)
  (incf (gethash (remove #\Newline (princ-to-string e)) *errors* 0)))

(defun open-connection (port)
  "A connected socket with the request sent, or NIL."
  (let ((s (handler-case (make-instance 'sb-bsd-sockets:inet-socket
                                        :type :stream :protocol :tcp)
             (error (e) (note-error e) nil))))
    (when s
      (handler-case (progn (sb-bsd-sockets:socket-connect s #(127 0 0 1) port)
                           (sb-bsd-sockets:socket-send s *request* nil)
                           s)
        (error (e)
          (note-error e)
          (ignore-errors (sb-bsd-sockets:socket-close s))
          nil)))))

(defun octets-string (octets end)
  (map 'string #'code-char (subseq octets 0 end)))

(defun response-complete-p (data)
  "If DATA holds a whole response, its status code; else NIL."
  (let* ((text (octets-string data (length data)))
         (head-end (search (format nil "~C~C~C~C" #\Return #\Newline #\Return #\Newline)
                           text)))
    (when head-end
      (let* ((head (string-downcase (subseq text 0 head-end)))
             (status (or (ignore-errors (parse-integer text :start 9 :end 12)) 0))
             (body-start (+ head-end 4))
             (cl (search "content-length:" head)))
        (cond (cl
               (let ((n (or (parse-integer head :start (+ cl 15) :junk-allowed t) 0)))
                 (and (>= (length data) (+ body-start n)) status)))
              ((search "chunked" head)
               (and (search (format nil "0~C~C~C~C" #\Return #\Newline #\Return #\Newline)
                            text :start2 body-start)
                    status))
              (t status))))))

(defun read-response (socket deadline)
  "Read one response on SOCKET; its status code, :CLOSED or :TIMEOUT."
  (let ((fd (sb-bsd-sockets:socket-file-descriptor socket))
        (buffer (make-array 4096 :element-type '(unsigned-byte 8)))
        (data (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0)))
    (loop
      (let ((remaining (- deadline (now-ms))))
        (when (or (<= remaining 0)
                  (not (sb-sys:wait-until-fd-usable fd :input (/ remaining 1000))))
          (return :timeout)))
      (let ((n (nth-value 1 (ignore-errors (sb-bsd-sockets:socket-receive socket buffer nil)))))
        (when (or (null n) (zerop n))
          (return :closed))
        (loop for i below n do (vector-push-extend (aref buffer i) data))
        (let ((status (response-complete-p data)))
          (when status (return status)))))))

(defun reply (control &rest args)
  (format *protocol* "~?~%" control args)
  (finish-output *protocol*))

(defun main ()
  (let ((args (rest sb-ext:*posix-argv*)))
    (unless (<= 2 (length args) 4)
      (format *error-output* "usage: idle.lisp --end-toplevel-options PORT N [TIMEOUT-S [BATCH]]~%")
      (sb-ext:exit :code 2 :abort t))
    (let* ((port (parse-integer (first args)))
           (n (parse-integer (second args)))
           (start (now-ms))
           (deadline (+ start (* 1000 (parse-integer (or (third args) "60")))))
           (*batch* (max 1 (parse-integer (or (fourth args) "32"))))
           (limit (raise-fd-limit))
           (held '())
           (failed 0) (connect 0) (non2xx 0) (closed 0) (timeouts 0))
      (when (< limit (+ n 64))
        (format *error-output* "idle helper: fd limit ~D is too low for ~D connections~%"
                limit n))
      ;; In batches: open and send on *BATCH* connections, then read their
      ;; responses, so the server sees a little concurrency but no storm.
      (loop with left = n
            while (plusp left)
            do (let ((batch '()))
                 (loop repeat (min left *batch*)
                       do (decf left)
                          (let ((s (and (< (now-ms) deadline) (open-connection port))))
                            (if s (push s batch) (incf connect))))
                 (dolist (s (nreverse batch))
                   (let ((status (read-response s deadline)))
                     (cond ((and (integerp status) (<= 200 status 299))
                            (push s held))
                           (t (case status
                                (:closed (incf closed))
                                (:timeout (incf timeouts))
                                (t (incf non2xx)))
                              (ignore-errors (sb-bsd-sockets:socket-close s))))))))
      (setf failed (+ connect non2xx closed timeouts))
      (maphash (lambda (message count)
                 (format *error-output* "idle helper: ~D x ~A~%" count message))
               *errors*)
      (finish-output *error-output*)
      (reply "HELD held=~D failed=~D connect=~D non2xx=~D closed=~D timeout=~D ms=~D"
             (length held) failed connect non2xx closed timeouts (- (now-ms) start))
      (loop for line = (read-line *standard-input* nil)
            while line
            do (let ((command (string-trim " " line)))
                 (cond ((string= command "check")
                        (reply "ALIVE ~D"
                               (count-if-not
                                (lambda (s)
                                  (sb-sys:wait-until-fd-usable
                                   (sb-bsd-sockets:socket-file-descriptor s) :input 0))
                                held)))
                       ((string= command "quit") (return)))))
      (sb-ext:exit :code 0 :abort t))))

(main)
